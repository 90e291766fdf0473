"""Dense convolutions and matrix products as sgemm calls: the im2col data movement (`im2col`), the
convolution kernels in TVMScript (`gemm_kernels`) and the sgemm calls they make (`blas`),
Relax's convolutions (`gemm`) and matmuls and einsums (`matmul`) lowered to them. The sgemm is
OpenBLAS's on a Linux board and planner's portable C one on a microcontroller; the choice is the
target's `kernels:`.
"""
