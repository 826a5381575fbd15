#!/usr/bin/env python3
"""Writes src/startup.ld, the linker script that puts the code `acp serve` and `mcp serve`
run from start-up to their `initialize` reply next to each other at the front of `.text`.
It is optional: release links use it only when built with `CALIBAN_STARTUP_LAYOUT=1`
(build.rs), and CI neither uses nor checks it; bench/RESULTS.md ("footprint gate") has what
it buys.

Why: the kernel maps a binary's pages in 64 KiB windows around each page fault (fault-around),
so the resident size of an idle server follows how many windows its start-up code is spread
over, not how much code it runs. Unordered, `initialize` touches about 300 KiB of functions
spread over 40 of the 55 windows of `.text`; gathered, they fill a handful.

How: the unstripped static release binary runs under valgrind's callgrind until it has
answered `initialize` (ACP and MCP), which lists every function executed. Rust functions
become section patterns with the symbol hash wildcarded (`.text._ZN…17h*`, `C*` for v0 crate
hashes), so the script survives rebuilds, profile changes and compiler upgrades; functions
that no longer exist simply match nothing. C functions (glibc's start-up, malloc, stdio) come
from static archives built without per-function sections, so whole archive members are
listed, with their ifunc variants (`strncmp-evex.o`, …) last: which variant runs depends on
the CPU. Valgrind does not see the vDSO set-up nor which ifunc variant the real CPU picks;
those members are added by name (`ALWAYS`), and `--check` confirms with `perf` that a real
run faults no code outside the hot section.

    python3 bench/layout.py                 # build, trace, write src/startup.ld (minutes)
    python3 bench/layout.py --binary PATH   # trace an existing unstripped build instead
    python3 bench/layout.py --check [PATH]  # perf: code page faults outside .text.hot
                                            # (of a build with CALIBAN_STARTUP_LAYOUT=1)

Needs valgrind (callgrind_control), binutils (nm, readelf) and, for --check, perf.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from initialize import initialize_line  # the same `initialize` the benchmark sends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "x86_64-unknown-linux-gnu"
# The README's release recipe; keep the two in step.
RUSTFLAGS = "-C target-feature=+crt-static -C relocation-model=static"
OUT = os.path.join(ROOT, "src", "startup.ld")

# C code a real start-up runs that callgrind does not report: the static binary's vDSO
# set-up (valgrind gives its guest no vDSO) and libm's ifunc resolver for trunc.
ALWAYS = [
    "_dl_new_object", "_dl_setup_hash", "_dl_lookup_symbol_x", "_dl_vdso_vsym",
    "_dl_non_dynamic_init", "__trunc",
]

ARCHIVES = ["libc.a", "libm-2.36.a", "libm.a", "libgcc_eh.a", "libgcc.a"]


def sh(argv, **kw):
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw).stdout


def env_for(tmp):
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": tmp,
        "XDG_STATE_HOME": os.path.join(tmp, "state"),
        "XDG_CONFIG_HOME": os.path.join(tmp, "config"),
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:9",
    }


def build():
    target_dir = os.path.join(ROOT, "target", "layout")
    env = dict(os.environ, RUSTFLAGS=RUSTFLAGS)
    subprocess.run(
        ["cargo", "build", "--release", "--target", TARGET, "--target-dir", target_dir,
         "--config", "profile.release.strip=false"],
        check=True, cwd=ROOT, env=env)
    return os.path.join(target_dir, TARGET, "release", "caliban")


def trace(binary, surface, tmp):
    """Function names callgrind saw from exec to the `initialize` reply."""
    out = os.path.join(tmp, f"callgrind.{surface}")
    child = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--demangle=no", f"--callgrind-out-file={out}",
         binary, surface, "serve"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=env_for(tmp), cwd=tmp)
    try:
        child.stdin.write(initialize_line(surface))
        child.stdin.flush()
        if not child.stdout.readline():
            sys.exit(f"{surface} serve under valgrind gave no reply")
        time.sleep(0.5)  # let the loop go back to waiting
        sh(["callgrind_control", "--dump", str(child.pid)])
        dump = out + ".1"
        for _ in range(100):
            if os.path.exists(dump) and os.path.getsize(dump) > 0:
                break
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        child.kill()
        child.wait()
    names, ids = [], {}
    for line in open(dump):
        m = re.match(r"^(c?fn)=\((\d+)\)(?: (.*))?$", line.rstrip("\n"))
        if not m:
            continue
        kind, num, name = m.groups()
        if name:
            ids[num] = re.sub(r"'\d+$", "", name)  # callgrind's recursion marker
        if kind == "fn" and ids.get(num) and ids[num] not in names:
            names.append(ids[num])
    return names


def rust_pattern(name):
    if name.startswith("_ZN"):
        return re.sub(r"17h[0-9a-f]{16}E$", "17h*", name)
    if name.startswith("_R"):
        return re.sub(r"Cs[0-9A-Za-z]+_", "C*", name)
    if name == "main":  # the C main rustc emits, in the Rust object
        return name
    return None


def archive_members():
    """symbol -> (archive, member) for the static C archives the release links."""
    where = {}
    for archive in ARCHIVES:
        path = sh(["cc", "-print-file-name=" + archive]).strip()
        if not os.path.isabs(path) or not os.path.exists(path):
            continue
        listing = subprocess.run(["nm", "-A", "--defined-only", path],
                                 capture_output=True, text=True).stdout
        for line in listing.splitlines():
            parts = line.split()
            if len(parts) < 3 or parts[-2] not in "tTwWi":
                continue
            loc = parts[0].rsplit("/", 1)[-1].split(":")
            if len(loc) >= 2:
                # libm.a is a linker script naming libm-2.36.a: match any version.
                name = "libm*.a" if archive.startswith("libm") else archive
                where.setdefault(parts[-1], (name, loc[1]))
    return where


def ifunc_resolvers(binary):
    """Names of the ifunc resolvers the binary's start-up calls (IRELATIVE relocations)."""
    addrs = set()
    for line in sh(["readelf", "-rW", binary]).splitlines():
        if "IRELATIVE" in line:
            addrs.add(int(line.split()[-1], 16))
    names = []
    for line in sh(["nm", "--defined-only", binary]).splitlines():
        parts = line.split()
        if len(parts) == 3 and int(parts[0], 16) in addrs:
            names.append(parts[2])
    return names


def write_script(names, binary, out):
    members = archive_members()
    patterns, objects, families = [], [], []
    for name in names + ALWAYS + ifunc_resolvers(binary):
        pattern = rust_pattern(name)
        if pattern is not None:
            if pattern not in patterns:
                patterns.append(pattern)
        elif name in members and members[name] not in objects:
            objects.append(members[name])
            archive, member = members[name]
            # `memmove-avx-unaligned-erms.o` is one variant of the family `memmove`.
            family = member[:-2].split("-")[0]
            if archive == "libc.a" and name in names and family not in families:
                families.append(family)
    lines = [
        "/* Generated by bench/layout.py: the functions `acp serve` and `mcp serve` run from",
        "   start-up to their `initialize` reply, gathered at the front of the code so an idle",
        "   server keeps few pages of the binary resident (RSS; private memory and PSS hardly",
        "   move). Optional: build.rs passes it to release links only with",
        "   CALIBAN_STARTUP_LAYOUT=1, and CI does not. Regenerate before using it on another",
        "   glibc or after large changes to start-up (README, \"Building a static release",
        "   binary\"); a pattern that matches nothing is harmless. */",
        "SECTIONS {",
        "  .text.hot : {",
    ]
    lines += [f"    *(.text.{p} .text.unlikely.{p})" for p in patterns]
    lines += [f"    *{a}:{m}(.text .text.*)" for a, m in objects]
    # Which ifunc variant of a string function runs depends on the CPU: all the variants of
    # those start-up calls, after everything else.
    lines += [f"    *libc.a:{f}-*.o(.text .text.*)" for f in families]
    lines += ["  }", "} INSERT BEFORE .text;", ""]
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print(f"{out}: {len(patterns)} Rust patterns, {len(objects)} C archive members")


def perf_faults(binary, surface):
    """`perf script` lines (ip, addr) of the page faults from exec to the `initialize` reply."""
    for _ in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            data = os.path.join(tmp, "perf.data")
            child = subprocess.Popen(
                ["perf", "record", "-q", "-e", "page-faults", "-c", "1", "-d", "-o", data,
                 "--", binary, surface, "serve"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env=env_for(tmp), cwd=tmp)
            child.stdin.write(initialize_line(surface))
            child.stdin.flush()
            child.stdout.readline()
            time.sleep(0.3)
            child.send_signal(2)  # perf stops recording here: the exit path is not start-up
            child.wait()
            script = subprocess.run(["perf", "script", "-i", data, "-F", "ip,addr"],
                                    capture_output=True, text=True)
            if script.returncode == 0:
                return script.stdout
    sys.exit(f"perf recorded nothing usable for {surface} serve")


def check(binary):
    """Code page faults outside .text.hot from exec to the `initialize` reply, with perf."""
    hot = None
    for line in sh(["readelf", "-SW", binary]).splitlines():
        parts = line.replace("[ ", "[").split()
        if len(parts) > 5 and parts[1] == ".text.hot":
            hot = (int(parts[3], 16), int(parts[3], 16) + int(parts[5], 16))
    if hot is None:
        sys.exit(f"{binary} has no .text.hot section: built without CALIBAN_STARTUP_LAYOUT=1")
    text = [(int(p[0], 16), p[2]) for p in
            (line.split() for line in sh(["nm", "-n", "--defined-only", binary]).splitlines())
            if len(p) == 3 and p[1] in "tTwWi"]
    outside = 0
    for surface in ("acp", "mcp"):
        faults = perf_faults(binary, surface)
        for line in faults.splitlines():
            parts = line.split()
            if len(parts) != 2 or parts[0] != parts[1]:
                continue  # a data fault
            addr = int(parts[0], 16)
            if hot[0] <= addr < hot[1] or addr >= 1 << 47:
                continue
            owner = max((t for t in text if t[0] <= addr), default=(0, "?"))[1]
            print(f"{surface}: code fault outside .text.hot at {addr:#x} in {owner}")
            outside += 1
    print(f".text.hot is {hot[1] - hot[0]} bytes; {outside} code faults outside it")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", help="an unstripped static release build to trace")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--check", nargs="?", const="", metavar="BINARY",
                    help="check a build (default: the README's release build) with perf")
    a = ap.parse_args()
    if a.check is not None:
        check(a.check or os.path.join(ROOT, "target", TARGET, "release", "caliban"))
        return
    binary = os.path.abspath(a.binary) if a.binary else build()
    with tempfile.TemporaryDirectory() as tmp:
        names = []
        for surface in ("acp", "mcp"):
            for name in trace(binary, surface, tmp):
                if name not in names:
                    names.append(name)
    write_script(names, binary, a.out)


if __name__ == "__main__":
    main()
