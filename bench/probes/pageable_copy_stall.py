"""Does a blocking CUDA call on the main thread hold up another thread's cudaMemcpyAsync/cudaEventQuery?

One GPU, no portep needed: a worker thread copies 1 MiB device-to-device in a loop through ctypes (which releases
the GIL) while the main thread queues a ~1 s kernel and then blocks in each scenario. Prints the worker's copies
in that window and their median / worst latency. Run: python bench/probes/pageable_copy_stall.py
(bench/results/RESULTS.md has the H200 figures: pageable copies held the worker up to ~1 s, synchronization
did not)."""
import ctypes, glob, os, statistics, threading, time
import torch

torch.cuda.init()
x = torch.ones(1, device="cuda")
path = None
for line in open("/proc/self/maps"):
    if "libcudart.so" in line:
        path = line.split()[-1]
        break
if path is None:
    cands = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*"))
    path = cands[0]
print("cudart:", path)
rt = ctypes.CDLL(path)
vp = ctypes.c_void_p
src = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
dst = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
lat, stop, marks = [], threading.Event(), []


def worker():
    assert rt.cudaSetDevice(0) == 0
    stream, ev = vp(), vp()
    assert rt.cudaStreamCreateWithFlags(ctypes.byref(stream), 1) == 0
    assert rt.cudaEventCreateWithFlags(ctypes.byref(ev), 2) == 0
    while not stop.is_set():
        t0 = time.perf_counter()
        rt.cudaMemcpyAsync(vp(dst.data_ptr()), vp(src.data_ptr()), ctypes.c_size_t(1 << 20), 3, stream)
        rt.cudaEventRecord(ev, stream)
        while rt.cudaEventQuery(ev) != 0:
            pass
        lat.append((t0, time.perf_counter() - t0))


th = threading.Thread(target=worker, daemon=True)
th.start()
time.sleep(0.5)
big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
cycles = int(1.0 * 1.9e9)
scen = {
    "idle": lambda: time.sleep(1.0),
    "stream.synchronize": lambda: (torch.cuda._sleep(cycles), torch.cuda.current_stream().synchronize()),
    "event.synchronize": lambda: (torch.cuda._sleep(cycles), torch.cuda.Event().record(), None)[-1] or _ev_sync(),
    "tensor.cpu (pageable)": lambda: (torch.cuda._sleep(cycles), big.cpu()),
    "torch.cuda.synchronize": lambda: (torch.cuda._sleep(cycles), torch.cuda.synchronize()),
    "pageable H2D .cuda()": lambda: (torch.cuda._sleep(cycles), torch.ones(16 << 20, dtype=torch.uint8).cuda()),
    "item()": lambda: (torch.cuda._sleep(cycles), x.sum().item()),
}


def _ev_sync():
    e = torch.cuda.Event()
    e.record()
    e.synchronize()


scen["event.synchronize"] = lambda: (torch.cuda._sleep(cycles), _ev_sync())
for name, fn in scen.items():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    window = [l for (s, l) in lat if t0 <= s <= t1]
    print(f"{name:24s} main {t1 - t0:.2f} s; worker copies in window {len(window)}, median "
          f"{statistics.median(window) * 1e6 if window else -1:.0f} us, max {max(window) * 1e3 if window else -1:.1f} ms",
          flush=True)
stop.set()
th.join(5)
