"""`python -m portep.doctor [--json]`: what this build contains and what this machine has."""

import argparse
import importlib
import json
import os
import platform
import sys
from typing import Optional

from ._native import native, native_error


def _rdma_devices():
    root = "/sys/class/infiniband"
    if not os.path.isdir(root):
        return [], "no RDMA devices: /sys/class/infiniband is absent (no RDMA support in this kernel or no device)"
    devices = []
    for name in sorted(os.listdir(root)):
        ports = os.path.join(root, name, "ports")
        port_info = {}
        for port in sorted(os.listdir(ports)) if os.path.isdir(ports) else []:

            def read(field, port=port):
                try:
                    with open(os.path.join(ports, port, field)) as f:
                        return f.read().strip()
                except OSError:
                    return None

            port_info[port] = {"state": read("state"), "link_layer": read("link_layer")}
        devices.append({"name": name, "ports": port_info, "efa": name.startswith("efa")})
    return devices, "" if devices else "no RDMA devices found"


def gpu_error_text(error: str, runtime: str, driver_loads: bool) -> str:
    """What the doctor says of a GPU runtime's error: CUDA answers "driver version is insufficient" also where there
    is no driver at all, which is named as such when the driver library does not load. driver_loads: whether
    libcuda.so.1 (CUDA) loads here."""
    if runtime == "cuda" and error and "insufficient" in error and not driver_loads:
        return f"no NVIDIA driver / no GPU found: libcuda.so.1 does not load (CUDA said: {error})"
    return error


def cuda_driver_loads() -> bool:
    """Whether libcuda.so.1, the NVIDIA driver's library, loads here."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _torch_facts():
    try:
        import torch
    except ImportError:
        return {"installed": False}
    facts = {
        "installed": True,
        "version": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
    }
    try:
        import torch.distributed as dist

        facts["distributed"] = dist.is_available()
        facts["gloo"] = dist.is_available() and dist.is_gloo_available()
        facts["nccl"] = dist.is_available() and dist.is_nccl_available()
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        facts["distributed_error"] = str(exc)
    if facts["cuda_available"]:
        try:
            facts["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001
            facts["nccl_version_error"] = str(exc)
    return facts


def _hip_facts(info):
    """The HIP build and ROCm's view of the GPUs (through hip-python, the optional `hip` extra, when installed)."""
    facts = {
        "built": info["hip_built"],
        "rocm_version": info["hip_version"] or None,
        "architectures": info["gpu_archs"] if info["hip_built"] else None,
    }
    try:
        from hip import hip
    except ImportError:
        facts["hip_python"] = "not installed (pip install 'portep[hip]' matching this ROCm, to list the GPUs)"
        return facts
    except Exception as exc:  # noqa: BLE001 - a hip-python for another ROCm fails here: reported
        facts["hip_python"] = f"cannot be used: {exc}"
        return facts
    try:
        err, count = hip.hipGetDeviceCount()
        facts["hip_python"] = "installed"
        facts["devices"] = int(count) if int(err) == 0 else 0
        if int(err):
            facts["devices_error"] = str(err)
    except Exception as exc:  # noqa: BLE001
        facts["hip_python"] = f"cannot be used: {exc}"
    return facts


def _build_problems(info, torch_facts):
    """A GPU build that this torch cannot drive (CUDA kernels with a ROCm torch, or the other way round)."""
    if not info.get("gpu_built") or not torch_facts.get("installed"):
        return []
    torch_hip = torch_facts.get("hip")
    if info["gpu_runtime"] == "hip" and not torch_hip and torch_facts.get("cuda"):
        return [
            "portep's GPU kernels were built for HIP (ROCm) but torch is a CUDA build: rebuild portep where nvcc "
            "is found (or with -Ccmake.define.PORTEP_GPU=cuda), or install a ROCm torch"
        ]
    if info["gpu_runtime"] == "cuda" and torch_hip:
        return [
            "portep's GPU kernels were built for CUDA but torch is a ROCm build: rebuild portep with "
            "-Ccmake.define.PORTEP_GPU=hip"
        ]
    return []


def _runtime_problems(torch_facts):
    """What portep needs at run time and cannot use here, one line each (empty: nothing missing)."""
    problems = []
    if not torch_facts.get("installed"):
        problems.append(
            "torch is not installed: install the build for this machine (CPU: pip install torch; CUDA: "
            "see pytorch.org), portep uses torch.distributed to bootstrap and torch tensors for data"
        )
    elif not torch_facts.get("gloo"):
        problems.append("torch.distributed has no gloo backend: Channel and the host backend bootstrap over gloo")
    try:
        import numpy  # noqa: F401
    except ImportError as exc:
        problems.append(
            f"numpy cannot be imported ({exc}): torch.distributed's object collectives, which portep's "
            f"bootstrap uses, need it: pip install numpy"
        )
    else:
        if torch_facts.get("installed"):
            try:
                import torch

                torch.zeros(1, dtype=torch.float32, device="cpu").numpy()
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                problems.append(f"torch cannot use numpy ({exc}): reinstall numpy for this torch")
    return problems


# DeepEP's three APIs: each one's class and the module DeepEP code imports it from
DEEPEP_APIS = (
    ("V1", "deep_ep", "Buffer"),
    ("V2", "deep_ep", "ElasticBuffer"),
    ("HybridEP", "deep_ep.hybrid_ep_buffer", "HybridEPBuffer"),
)


def apis_served() -> dict:
    """{API: what serves it}: the class DeepEP code reaches under `deep_ep` and the module that defines it (portep's,
    or a real DeepEP's where that owns the name), or why it cannot be reached."""
    served = {}
    for api, module, name in DEEPEP_APIS:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            served[api] = f"not served: {module}.{name} cannot be imported ({e})"
            continue
        served[api] = f"{module}.{name}, from {cls.__module__}"
    return served


def collect() -> dict:
    """Everything the doctor reports, as a dict (what format_text prints)."""
    report = {
        "version": None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "native": native is not None,
        "backends": [],
        "backends_unavailable": {},
        "transports": {},
        "gpus": {"count": 0},
    }
    from . import __version__

    report["version"] = __version__
    if native is None:
        report["native_error"] = native_error
        return report
    info = native.build_info()
    report["build"] = info
    if info["gpu_built"]:
        from .backends.cuda.ll_jit import describe

        info["ll_fast_path"] = describe(info)
    else:
        info["ll_fast_path"] = f"not built ({info.get('ll_fast_path_reason')}; LL calls take the Python path)"
    report["backends"].append("host")
    gpu_count, gpu_error = native.cuda_devices()
    gpu_error = gpu_error_text(gpu_error, info["gpu_runtime"], gpu_error == "" or cuda_driver_loads())
    report["gpus"] = {"count": gpu_count}
    if gpu_error:
        report["gpus"]["error"] = gpu_error
    runtime = info["gpu_runtime"].upper()
    if info["gpu_built"] and gpu_count > 0:
        report["backends"].append("cuda")
    elif info["gpu_built"]:
        report["backends_unavailable"]["cuda"] = (
            f"{runtime} kernels built, but no usable GPU: {gpu_error or 'no device'}"
        )
    else:
        report["backends_unavailable"]["cuda"] = f"kernels not built: {info['gpu_reason']}"
    if not info["hip_built"]:
        report["backends_unavailable"]["hip"] = f"not built: {info['hip_reason']}"
    report["hip"] = _hip_facts(info)
    for t in native.transport_catalog():
        entry = {k: t[k] for k in ("built", "ordered", "remote_atomics")}
        for key in ("usable", "reason", "note"):
            if key in t:
                entry[key] = t[key]
        report["transports"][t["name"]] = entry
    report["nic_libraries"] = native.nic_libraries()  # loaded with dlopen when a verbs transport is asked for
    from .nccl_library import probe as nccl_probe

    report["nccl_library"] = nccl_probe()
    from .nccl_device import device_path_problem

    headers = info["nccl_device_headers"]
    report["nccl_device_path"] = {
        "headers": f"{headers // 10000}.{headers // 100 % 100}.{headers % 100}" if headers else "",
        "problem": device_path_problem(),
    }
    devices, why = _rdma_devices()
    report["rdma_devices"] = devices
    report["verbs_ports"] = native.verbs_devices()  # what libibverbs itself opens (atomics, link layer)
    if why:
        report["rdma_note"] = why
    report["torch"] = _torch_facts()
    report["apis"] = apis_served()
    report["problems"] = _runtime_problems(report["torch"]) + _build_problems(info, report["torch"])
    return report


def format_text(r: dict) -> str:
    """The report of collect() as the lines the doctor prints."""
    lines = [f"portep {r['version']} (python {r['python']}, {r['platform']})"]
    if not r["native"]:
        lines.append(f"  native module: MISSING: {r.get('native_error')}")
        return "\n".join(lines)
    lines.append("  DeepEP APIs (import deep_ep):")
    for api, what in r.get("apis", {}).items():
        lines.append(f"    {api:8s} {what}")
    lines.append(f"  backends:   {', '.join(r['backends'])}")
    for name, why in r["backends_unavailable"].items():
        lines.append(f"    {name:8s} unavailable: {why}")
    lines.append("  transports:")
    for name, t in r["transports"].items():
        if not t["built"]:
            lines.append(f"    {name:14s} not built: {t['reason']}")
        elif not t.get("usable", True):
            lines.append(f"    {name:14s} built, not usable here: {t['reason']}")
        else:
            note = f"  ({t['note']})" if t.get("note") else ""
            lines.append(f"    {name:14s} built  ordered={t['ordered']}  remote_atomics={t['remote_atomics']}{note}")
    lines.append("  NIC libraries (loaded when a verbs transport is asked for):")
    for line in r.get("nic_libraries", []):
        lines.append(f"    {line}")
    if "nccl_library" in r:
        lines.append(f"  NCCL library (for the nccl transport): {r['nccl_library']['summary']}")
    if "nccl_device_path" in r:
        d = r["nccl_device_path"]
        built = f"built against NCCL {d['headers']}'s device headers" if d["headers"] else "not built"
        usable = f"not usable here: {d['problem']}" if d["problem"] else "usable"
        lines.append(f"  NCCL device path: {built}; {usable}")
    gpu = r["gpus"]
    lines.append(f"  GPUs:       {gpu['count']}" + (f" ({gpu['error']})" if gpu.get("error") else ""))
    note = f" ({r['rdma_note']})" if r.get("rdma_note") else ""
    lines.append(f"  RDMA:       {len(r['rdma_devices'])} device(s){note}")
    for d in r["rdma_devices"]:
        lines.append(f"    {d['name']}{' (EFA)' if d['efa'] else ''}: {d['ports']}")
    for port in r.get("verbs_ports", []):
        lines.append(f"    verbs: {port}")
    t = r["torch"]
    if t.get("installed"):
        extra = f", NCCL {t['nccl_version']}" if t.get("nccl_version") else ""
        lines.append(
            f"  torch:      {t['version']} cuda={t['cuda_available']} gloo={t.get('gloo')} nccl={t.get('nccl')}{extra}"
        )
    else:
        lines.append("  torch:      not installed (needed for Channel bootstrap over torch.distributed)")
    b = r["build"]
    gpu = f"{b['gpu_runtime'].upper()} for {b['gpu_archs']}" if b["gpu_built"] else "none"
    lines.append(f"  compiler:   {b['compiler']}; GPU kernels: {gpu}")
    lines.append(f"  LL fast path (portep._ll_torch): {b.get('ll_fast_path', '?')}")
    h = r.get("hip", {})
    if h.get("built"):
        lines.append(
            f"  HIP:        ROCm {h.get('rocm_version')}, devices: {h.get('devices', '?')} "
            f"(hip-python: {h.get('hip_python')})"
        )
    for p in r["problems"]:
        lines.append(f"  PROBLEM:    {p}")
    if not r["problems"]:
        lines.append("  run time:   torch, torch.distributed (gloo) and numpy usable")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    """python -m portep.doctor [--json]."""
    parser = argparse.ArgumentParser(prog="python -m portep.doctor", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    args = parser.parse_args(argv)
    report = collect()
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0 if report["native"] and not report.get("problems") else 1


if __name__ == "__main__":
    sys.exit(main())
