/* Bare-metal start-up for an emulated Cortex-M board (planner's `qemu` runner): the vector table,
   .data copied from flash, .bss zeroed, the FPU switched on, then main(). No OS, no heap. */
#include <stdint.h>

extern uint32_t __data_load, __data_start, __data_end, __bss_start, __bss_end, __stack_top;
extern int main(void);
extern void planner_systick(void);

void reset_handler(void);

static void hang(void) {
  for (;;) {
  }
}

__attribute__((section(".vectors"), used)) static void (*const vectors[16])(void) = {
    (void (*)(void))(&__stack_top), reset_handler, hang, hang, hang, hang, hang, 0, 0, 0, 0, hang, hang, 0, hang,
    planner_systick,
};

void reset_handler(void) {
  uint32_t* src = &__data_load;
  for (uint32_t* dst = &__data_start; dst < &__data_end;) *dst++ = *src++;
  for (uint32_t* dst = &__bss_start; dst < &__bss_end;) *dst++ = 0;
#if defined(__ARM_FP)
  *(volatile uint32_t*)0xE000ED88 |= 0xFu << 20; /* CPACR: CP10 and CP11 full access */
  __asm volatile("dsb\n\tisb");
#endif
  main();
  hang();
}
