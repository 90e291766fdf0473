"""What loads and runs a compiled step in this process: the step's calling convention and a
session that holds its weights and steps it (`session`), the stored form of its weights
(`weights`), the kernel library it links (`libraries`: OpenBLAS, found and loaded) and the
threads it runs on (`threads`). Below the back ends, which build to this convention, and the
runners, which time and train with it; it imports neither.
"""
