"""The training graph: a candidate's ONNX model imported into Relax (`importer`, `rewrites`), made
differentiable with planner's own gradients where TVM has none (`gradients`), and built into one
training step — forward, loss, backward and optimizer update (`training`, `trainer`) — with
frozen weights stored as the candidate says (`weights`), LoRA adapters applied as two thin
products (`adapters`), a language model's head and token loss in chunks of tokens (`head`, its
kernel in `tir`), activations recomputed or computed in
row bands where that saves memory (`recompute`, `bands`), and its peak memory told before
anything is compiled (`memory`, `estimate`). Target-independent: nothing here knows a board.
"""
