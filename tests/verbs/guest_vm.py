"""Run a command inside a qemu guest that has real verbs on soft-RoCE (rdma_rxe), for the verbs tests.

The development and CI machines have no RDMA in their kernel (and no usable KVM), so the guest runs under TCG:
Debian's 6.1 kernel (its .deb downloaded with apt on first use and cached), an initramfs of busybox plus the
modules rdma_rxe needs, the host's / mounted read-only over 9p and chrooted into, a writable 9p share for the
output, and an rxe device on a veth pair. See shared reference/dev-machine.md for the recipe and its timings.
"""

import gzip
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

VERIFIED_KERNEL = "linux-image-6.1.0-"
CACHE = Path(os.environ.get("PORTEP_GUEST_CACHE", Path.home() / ".cache" / "portep-guest"))
MODULES = [
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "netfs",
    "fscache",
    "9pnet",
    "9p",
    "9pnet_virtio",
    "crc32_generic",
    "udp_tunnel",
    "ip6_udp_tunnel",
    "ib_core",
    "ib_uverbs",
    "rdma_rxe",
    "veth",
]
PACKAGES = {"qemu-system-x86_64": "qemu-system-x86", "busybox": "busybox-static", "cpio": "cpio", "rdma": "iproute2"}

INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in {modules}; do insmod /modules/$m.ko || echo "insmod $m failed"; done
mkdir -p /host
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144 hostroot /host
mount -t proc proc /host/proc; mount -t sysfs sys /host/sys; mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/shm; mount -t tmpfs shm /host/dev/shm
# Scratch space on /run, not /tmp: a tmpfs over /tmp would hide a checkout that lives there.
mount -t tmpfs run /host/run
mkdir -p /host/run/portep-out /host/run/portep-tmp
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 out /host/run/portep-out
chroot /host /bin/sh /run/portep-out/guest.sh > /host/run/portep-out/output.txt 2>&1
echo $? > /host/run/portep-out/rc
poweroff -f
"""

GUEST_SH = """set -e
export HOME=/run/portep-tmp TMPDIR=/run/portep-tmp PYTHONDONTWRITEBYTECODE=1 GLOO_SOCKET_IFNAME=lo PATH={path}
ip link set lo up
ip link add veth0 type veth peer name veth1
ip link set veth0 up; ip link set veth1 up
rdma link add rxe0 type rxe netdev veth0
echo "portep-guest: rxe0 is up"
sleep 1
cd {cwd}
{command}
"""


def _installed(pkg):
    return subprocess.run(["dpkg", "-s", pkg], capture_output=True).returncode == 0


def _ensure_packages():
    missing = sorted({pkg for tool, pkg in PACKAGES.items() if shutil.which(tool) is None or not _installed(pkg)})
    if missing:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True, env=env)


def _version_key(name):
    return [int(p) for p in re.findall(r"\d+", name)]


def _kernel_dir():
    """Extracts a kernel .deb (downloaded once; Debian's 6.1 series, on which the recipe was verified, when apt has
    it, else the newest linux-image-X-N-amd64) and returns (vmlinuz, modules dir)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    debs = sorted(CACHE.glob("linux-image-*-amd64_*.deb"), key=lambda p: _version_key(p.name))
    if not debs:
        names = subprocess.run(
            ["apt-cache", "search", "--names-only", r"^linux-image-[0-9][0-9.]*-[0-9]+-amd64$"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        pkgs = sorted((n for n in names if re.fullmatch(r"linux-image-[0-9][0-9.]*-[0-9]+-amd64", n)), key=_version_key)
        preferred = [n for n in pkgs if n.startswith(VERIFIED_KERNEL)] or pkgs
        if not preferred:
            raise RuntimeError("apt offers no linux-image-*-amd64 package for the verbs guest")
        subprocess.run(["apt-get", "download", preferred[-1]], cwd=CACHE, check=True, capture_output=True)
        debs = sorted(CACHE.glob("linux-image-*-amd64_*.deb"), key=lambda p: _version_key(p.name))
    verified = [d for d in debs if d.name.startswith(VERIFIED_KERNEL)]
    deb = (verified or debs)[-1]
    root = CACHE / deb.stem
    if not (root / "done").exists():
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        (root / "done").touch()
    vmlinuz = next((root / "boot").glob("vmlinuz-*"))
    modules = next((root / "lib" / "modules").iterdir())
    return vmlinuz, modules


def _find_module(modules, name):
    """The module file, or None (another kernel may have it built in or under another name)."""
    for suffix in (".ko", ".ko.xz", ".ko.zst", ".ko.gz"):
        hits = list(modules.rglob(name + suffix))
        if hits:
            return hits[0]
    return None


def _initramfs(modules):
    """busybox + the modules (decompressed) + /init, as a gzip'd newc cpio; cached."""
    recipe = hashlib.sha256((INIT + " ".join(MODULES)).encode()).hexdigest()[:12]
    out = CACHE / f"initramfs-{modules.name}-{recipe}.gz"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        for sub in ("bin", "modules", "proc", "sys", "dev"):
            (d / sub).mkdir()
        shutil.copy("/bin/busybox", d / "bin" / "busybox")
        present = []
        for m in MODULES:
            src = _find_module(modules, m)
            if src is None:
                continue
            present.append(m)
            dst = d / "modules" / f"{m}.ko"
            if src.suffix == ".xz":
                subprocess.run(f"xz -dc '{src}' > '{dst}'", shell=True, check=True)
            elif src.suffix == ".zst":
                subprocess.run(["zstd", "-q", "-d", str(src), "-o", str(dst)], check=True)
            else:
                shutil.copy(src, dst)
        init = d / "init"
        init.write_text(INIT.format(modules=" ".join(present)))
        init.chmod(0o755)
        files = subprocess.run("find . -print0", shell=True, cwd=d, capture_output=True, check=True).stdout
        cpio = subprocess.run(
            ["cpio", "--null", "-o", "-H", "newc", "--quiet"], input=files, cwd=d, capture_output=True, check=True
        ).stdout
        out.write_bytes(gzip.compress(cpio))
    return out


class GuestUnavailable(RuntimeError):
    """The guest booted a kernel other than the verified 6.1 series and soft-RoCE did not come up in it."""


def run_in_guest(command, cwd, timeout=900):
    """Boots the guest, runs `command` (sh) in `cwd` of the chrooted host root; returns (rc, output, seconds).
    Raises GuestUnavailable when rxe could not be set up on a kernel the recipe was not verified on."""
    _ensure_packages()
    vmlinuz, modules = _kernel_dir()
    initrd = _initramfs(modules)
    with tempfile.TemporaryDirectory(prefix="portep-guest-") as out:
        out = Path(out)
        (out / "guest.sh").write_text(
            GUEST_SH.format(path=os.environ.get("PATH", "/usr/bin:/bin"), cwd=cwd, command=command)
        )
        qemu = [
            "qemu-system-x86_64",
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            "max",
            "-m",
            "3072",
            "-smp",
            "2",
            "-nographic",
            "-no-reboot",
            "-nic",
            "none",
            "-kernel",
            str(vmlinuz),
            "-initrd",
            str(initrd),
            "-append",
            "console=ttyS0 quiet panic=-1",
            "-virtfs",
            "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            "-virtfs",
            f"local,path={out},mount_tag=out,security_model=none",
        ]
        start = time.monotonic()
        try:
            console = subprocess.run(qemu, capture_output=True, text=True, timeout=timeout).stdout
        except subprocess.TimeoutExpired as e:
            console = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return 124, f"guest timed out after {timeout} s\n{console[-4000:]}", time.monotonic() - start
        seconds = time.monotonic() - start
        output = (out / "output.txt").read_text(errors="replace") if (out / "output.txt").exists() else ""
        rc_file = out / "rc"
        rc = int(rc_file.read_text().strip() or 1) if rc_file.exists() else 1
        if not rc_file.exists():
            output += f"\n[the guest wrote no exit status; console tail]\n{console[-4000:]}"
        if "portep-guest: rxe0 is up" not in output and not modules.name.startswith("6.1.0-"):
            raise GuestUnavailable(
                f"soft-RoCE did not come up in a guest with kernel {modules.name} (the recipe is "
                f"verified with Debian's 6.1 kernels, which this machine's apt does not offer):\n"
                f"{output[-2000:]}"
            )
        return rc, output, seconds
