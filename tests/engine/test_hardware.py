"""The machine's CPU name: two CPUs that a virtual machine names alike ("AMD EPYC") but that differ in generation are
told apart by their family and model numbers, in the fingerprint and in the kernel chooser's key."""
from engine.hardware import cpu_info

ZEN = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: {family}
model\t\t: {model}
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16
"""


def test_cpus_named_alike_are_told_apart_by_family_and_model(tmp_path):
    names = []
    for family, model in ((25, 17), (26, 2)):
        path = tmp_path / f"cpuinfo{family}"
        path.write_text(ZEN.format(family=family, model=model) + "\nprocessor\t: 1\nmodel name\t: other\n")
        name, flags = cpu_info(str(path))
        assert name == f"AMD EPYC, family {family} model {model}"
        assert flags["avx512_bf16"] and flags["avx2"] and not flags["amx_tile"]
        names.append(name)
    assert names[0] != names[1]


def test_a_cpu_without_numbers_keeps_its_name(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("model name\t: Some CPU\nflags\t\t: avx2\n")
    name, flags = cpu_info(str(path))
    assert name == "Some CPU" and [f for f, has in flags.items() if has] == ["avx2"]
