"""Lowering: a training module made a static program for one target (`pipeline`) — planner's
legalizations where TVM's waste work (`kernels`; int8 weights read in place on a microcontroller,
`portable`), fusion with weight-only values kept out of large kernels' loops (`hoist`), a default
schedule for every kernel (`schedule`, `schedule_plans`, `fast_math`) or MetaSchedule's tuned one
(`tune`), updates and activations written over the buffers they replace (`inplace`,
`activations`, `sparse`), storages shared by lifetime (`storage`), and per-kernel object files
linked by content (`link`). Both back ends generate their code from what `pipeline.lower_step`
returns.
"""
