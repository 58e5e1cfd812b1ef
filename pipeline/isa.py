"""Instruction-set levels (conf/isa/): `native` narrows nothing; another level holds torch's kernels, MKL, oneDNN and
the lab's native kernels to a narrower set through their environment variables, so that a CPU with AVX-512 runs what
one without it runs. Those libraries read the variables once, at first use: `apply` therefore executes the process
again with them set (once, before any work), and its children inherit them. `held` says what the environment holds
a process to, for the machine's fingerprint, so an emulated run never passes for a native one."""
import os
import sys

from engine import hardware
from engine.kernels import BUILD_VAR, ISA_LIMITS
from pipeline.config import group_entry, options

VARS = (*ISA_LIMITS, BUILD_VAR)  # every environment variable a level sets
REEXEC = "LAB_ISA_REEXEC"  # "<pid>:<level>": that process was executed again under that level (execve keeps the pid)


def vector_unit(flags: dict[str, bool]) -> str:
    """A CPU's widest vector unit, from engine.hardware.cpu_info's flags."""
    return "AVX-512" if flags.get("avx512f") else "AVX2" if flags.get("avx2") else "no AVX2"


def asked(level) -> dict[str, str]:
    """The environment variables a level (a conf/isa entry) sets, its kernel build's among them."""
    kernels = {BUILD_VAR: level["kernels"]} if level["kernels"] else {}
    return {**level["env"], **kernels}


def apply(level) -> None:
    """Run this process under `level` (a conf/isa entry): where the environment differs from what the level asks,
    the same command is executed again with it set, once. A CPU without the level's units fails naming what it has;
    a process already executed again for another level fails too (one level per process: a Hydra multirun over
    levels needs a launcher that starts a process per job)."""
    units = hardware.cpu_units()
    missing = [f for f in level["needs"] if f not in units]
    if missing:
        cpu, flags = hardware.cpu_info()
        runs = [o for o in options("isa") if set(group_entry("isa", o)["needs"]) <= units]
        raise ValueError(f"isa={level['name']} needs the CPU flags {missing}; this CPU ({cpu}) has "
                         f"{vector_unit(flags)}: choose an isa of {runs}")
    env = asked(level)
    pid, _, name = os.environ.get(REEXEC, "").partition(":")
    again = pid == str(os.getpid())
    if again and name != level["name"]:
        raise RuntimeError(f"this process runs isa={name}; isa={level['name']} needs a process of its own")
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    if again:
        raise RuntimeError(f"isa={level['name']}: the environment still differs from {env} once executed again")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, **env, REEXEC: f"{os.getpid()}:{level['name']}"})


def held(flags: dict[str, bool]) -> str:
    """What the environment holds this process to, on a CPU with these flags (engine.hardware.cpu_info's): `native`;
    a level of conf/isa, emulated where the CPU has a wider unit; or `custom`, naming the variables set."""
    given = {k: os.environ[k] for k in VARS if os.environ.get(k)}
    if not given:
        return "native"
    cpu = vector_unit(flags)
    for name in options("isa"):
        level = group_entry("isa", name)
        if asked(level) == given:
            held_to = f"torch, MKL, oneDNN and the lab's kernels held to {level['kernels']}"
            if level["unit"] == cpu:
                return f"{name} ({held_to}, this CPU's widest)"
            return f"{name} (emulated: {held_to} on a CPU with {cpu})"
    return f"custom ({', '.join(f'{k}={v}' for k, v in given.items())} set in the environment, on a CPU with {cpu})"


def unit(record: str, flags: dict[str, bool]) -> str | None:
    """How a machine's label names the vector unit of a process held as `record` (held's): None where native (the
    label names the CPU's widest), else the level's unit and, where emulated, on what."""
    name = record.split(" (")[0]
    if name == "native":
        return None
    if name not in options("isa"):
        return f"{vector_unit(flags)}, limited by the environment"
    level_unit = group_entry("isa", name)["unit"]
    return f"{level_unit}, emulated on {vector_unit(flags)}" if record.startswith(f"{name} (emulated") else level_unit
