/* The emulated board's side of planner's `qemu` runner: one generated training step (train_step.h)
   served over two host files through Arm semihosting, `in` (commands and data from planner) and
   `out` (results), both in qemu's working directory.

   Every message is little-endian. After start-up the board writes "PLNR", the protocol version
   (u32) and how many instructions one SysTick tick is (f32, measured here on a loop of known
   length); then it serves one-byte commands until `Q`:

     C  the frozen weights in, each of planner_frozen_bytes[i]  -> 'k' when they are the ones in flash, else 'x'
     L  state tensors in, each of planner_state_bytes[i]        -> 'k'
     S  a batch (every input, then the labels) in; one step     -> rc (i32), loss (f32), ticks (u64)
     K  as S, each kernel call's ticks (u32) first, in order    -> ticks x PLANNER_N_CALLS, then as S
     P  a predict batch of every input in                      -> rc (i32), logits (f32 ...)
     W                                                          -> the state tensors
     Q                                                          -> 'k', then qemu exits with 0

   Under `qemu -icount shift=0` a tick is a fixed number of instructions, so the ticks of a step
   count its instructions exactly, whatever the host is doing. */
#include <stdint.h>
#include <string.h>

#include "train_step.h"

#define PROTOCOL_VERSION 1u
#define SYST_CSR (*(volatile uint32_t*)0xE000E010)
#define SYST_RVR (*(volatile uint32_t*)0xE000E014)
#define SYST_CVR (*(volatile uint32_t*)0xE000E018)
#define RELOAD 0xFFFFFFu

/* Arm semihosting, called directly: the C library's own layer (rdimon) brings a heap and stdio's
   tables into SRAM, which a step on a board does not have. */
enum { SYS_OPEN = 0x01, SYS_WRITE = 0x05, SYS_READ = 0x06, SYS_EXIT_EXTENDED = 0x20 };

static int32_t semihost(int32_t operation, void* argument) {
  register int32_t r0 __asm__("r0") = operation;
  register void* r1 __asm__("r1") = argument;
  __asm__ volatile("bkpt 0xab" : "+r"(r0) : "r"(r1) : "memory");
  return r0;
}

static int32_t open_file(const char* name, int32_t mode) { /* mode 1: "rb", 5: "wb" */
  uint32_t args[3] = {(uint32_t)name, (uint32_t)mode, (uint32_t)strlen(name)};
  return semihost(SYS_OPEN, args);
}

static int32_t transfer(int32_t operation, int32_t handle, const void* data, uint32_t n) {
  uint32_t args[3] = {(uint32_t)handle, (uint32_t)data, n};
  return (int32_t)n - semihost(operation, args); /* the call returns the bytes NOT transferred */
}

static void leave(uint32_t code) {
  uint32_t args[2] = {0x20026u, code}; /* ADP_Stopped_ApplicationExit */
  semihost(SYS_EXIT_EXTENDED, args);
  for (;;) {
  }
}

static volatile uint32_t wraps;

void planner_systick(void) { wraps++; }

static uint64_t ticks(void) {
  uint32_t before, value;
  do {
    before = wraps;
    value = SYST_CVR;
  } while (before != wraps);
  return (uint64_t)before * (RELOAD + 1u) + (RELOAD - value);
}

static void start_ticks(void) {
  SYST_RVR = RELOAD;
  SYST_CVR = 0;
  SYST_CSR = 7; /* processor clock, interrupt on wrap, enabled */
  while (SYST_CVR == 0) {
  } /* the counter loads on the next tick */
}

static int32_t in_fd, out_fd;

static void fail(uint32_t code) { leave(code); }

static void read_exact(void* data, uint32_t n) {
  uint8_t* p = (uint8_t*)data;
  while (n) {
    int32_t got = transfer(SYS_READ, in_fd, p, n);
    if (got <= 0) fail(3);
    p += got;
    n -= (uint32_t)got;
  }
}

static void write_exact(const void* data, uint32_t n) {
  const uint8_t* p = (const uint8_t*)data;
  while (n) {
    int32_t put = transfer(SYS_WRITE, out_fd, p, n);
    if (put <= 0) fail(4);
    p += put;
    n -= (uint32_t)put;
  }
}

static uint8_t profiling;
static uint64_t since;

/* After each kernel of a profiled step: its ticks since the last one, written out at once (nothing
   kept in SRAM), the write itself left out of the next kernel's count. */
void planner_kernel_done(int32_t index) {
  (void)index;
  if (!profiling) return;
  uint32_t spent = (uint32_t)(ticks() - since);
  write_exact(&spent, 4);
  since = ticks();
}

static float instructions_per_tick(void) {
  const uint32_t loops = 1u << 20; /* two instructions each: subs, bne */
  uint32_t n = loops;
  uint64_t t0 = ticks();
  __asm volatile("1: subs %0, %0, #1\n\tbne 1b" : "+r"(n) : : "cc");
  uint64_t t1 = ticks();
  return (float)(2.0 * loops / (double)(t1 - t0));
}

int main(void) {
  start_ticks();
  float per_tick = instructions_per_tick();
  in_fd = open_file("in", 1);
  out_fd = open_file("out", 5);
  if (in_fd < 0 || out_fd < 0) fail(2);
  planner_init();
  uint32_t version = PROTOCOL_VERSION;
  write_exact("PLNR", 4);
  write_exact(&version, 4);
  write_exact(&per_tick, 4);
  for (;;) {
    uint8_t command;
    read_exact(&command, 1);
    if (command == 'C') {
      uint8_t same = 1, chunk[64];
      for (uint32_t i = 0; i < PLANNER_N_FROZEN; ++i) {
        const uint8_t* flash = (const uint8_t*)planner_frozen[i];
        for (uint32_t done = 0; done < planner_frozen_bytes[i];) {
          uint32_t n = planner_frozen_bytes[i] - done < sizeof(chunk) ? planner_frozen_bytes[i] - done : sizeof(chunk);
          read_exact(chunk, n);
          same &= memcmp(chunk, flash + done, n) == 0;
          done += n;
        }
      }
      write_exact(same ? "k" : "x", 1);
    } else if (command == 'L') {
      for (uint32_t i = 0; i < PLANNER_N_STATE; ++i) read_exact(planner_state[i], planner_state_bytes[i]);
      write_exact("k", 1);
    } else if (command == 'S' || command == 'K') {
      for (uint32_t i = 0; i < PLANNER_N_INPUTS; ++i) read_exact(planner_inputs[i], planner_input_bytes[i]);
      read_exact(planner_labels, sizeof(planner_labels));
      float loss = 0;
      profiling = command == 'K';
      uint64_t t0 = ticks();
      since = t0;
      int32_t rc = planner_train(&loss);
      uint64_t spent = ticks() - t0;
      profiling = 0;
      write_exact(&rc, 4);
      write_exact(&loss, 4);
      write_exact(&spent, 8);
    } else if (command == 'P') {
      for (uint32_t i = 0; i < PLANNER_N_INPUTS; ++i) read_exact(planner_inputs[i], planner_predict_bytes[i]);
      int32_t rc = planner_predict();
      write_exact(&rc, 4);
      write_exact(planner_logits, sizeof(planner_logits));
    } else if (command == 'W') {
      for (uint32_t i = 0; i < PLANNER_N_STATE; ++i) write_exact(planner_state[i], planner_state_bytes[i]);
    } else if (command == 'Q') {
      write_exact("k", 1);
      leave(0);
    } else {
      fail(5);
    }
  }
}
