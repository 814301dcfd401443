"""The engines behind portep.Buffer: `host` (CPU threads over host memory) and `cuda` (the GPU kernels, CUDA or HIP),
each in its own package; `common` holds what both share. Buffer imports an engine; engines import only `common`
and the modules below them (channel, lockstep, topology, the native module)."""
