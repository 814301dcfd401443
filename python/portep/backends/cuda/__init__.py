"""The CUDA backend (also HIP on a ROCm torch): the GPU kernels of portep._C driven from engine.py and ht.py."""
