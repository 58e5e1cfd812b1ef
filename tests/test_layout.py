"""The code's rooms keep their roles: engine/core (no model, no kernels, no torch), engine/kernels (no core, no
model), no import circle among the project's modules (imports inside functions included), and every Python file
small enough to read whole."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "pipeline", "servers")
MAX_LINES = 350


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the project's packages."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, names: set[str]) -> set[str]:
    """The project's modules a file imports, anywhere in it (`from a import b` counts a.b where that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m in names}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def test_core_imports_neither_model_nor_kernels_nor_torch():
    for name, path in modules().items():
        if name.startswith("engine.core"):
            text = path.read_text()
            assert "torch" not in imports_of(text), f"{name} imports torch"
            bad = {m for m in graph()[name] if m.startswith(("engine.model", "engine.kernels"))}
            assert not bad, f"{name} imports {sorted(bad)}"


def imports_of(text: str) -> set[str]:
    """Top-level package names a source imports."""
    tree = ast.parse(text)
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_kernels_import_neither_core_nor_model():
    for name, deps in graph().items():
        if name.startswith("engine.kernels"):
            bad = {m for m in deps if m.startswith(("engine.core", "engine.model"))}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_no_import_circle():
    g = graph()
    for name in g:  # packages import their own modules' parents implicitly; a package's __init__ is its name
        g[name] = {d for d in g[name] if not name.startswith(d + ".")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g[node]):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep):] + [node, dep]))
            if dep not in state:
                visit(dep, path + [node])
        state[node] = 2

    for name in sorted(g):
        if name not in state:
            visit(name, [])


def test_every_python_file_is_short():
    long = {str(p.relative_to(ROOT)): n for p in [*modules().values(), *(ROOT / "tests").rglob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_no_native_source_outside_the_kernels_room():
    stray = [str(p.relative_to(ROOT)) for ext in ("*.cpp", "*.h") for p in (ROOT / "engine").rglob(ext)
             if "kernels/csrc" not in str(p)]
    assert not stray, f"C++ outside engine/kernels/csrc: {stray}"


def python_files(*rooms: str) -> list[Path]:
    return [p for room in rooms for p in (ROOT / room).rglob("*.py")]


def test_outside_the_engine_models_and_engines_are_built_by_the_factory():
    """engine/factory.py builds the engine's model (its architecture's class) and the engine; nothing outside
    engine/ constructs either."""
    from engine.model.models import ARCHITECTURES

    names = "|".join(["FlatModel", "LLMEngine", *{cls.__name__ for cls in ARCHITECTURES.values()}])
    built = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in python_files("pipeline", "servers", "tests")
             for m in re.finditer(rf"\b({names})\(", p.read_text())]
    assert not built, f"built outside engine/factory.py: {built}"


def test_a_family_is_named_only_in_its_own_file():
    """No Python under engine/ names Gemma outside its architecture's file."""
    named = [str(p.relative_to(ROOT)) for p in python_files("engine")
             if "gemma" in p.read_text().lower() and p.name != "gemma3.py"]
    assert not named, f"Gemma named outside engine/model/models/gemma3.py: {named}"


def test_a_policy_is_a_record_not_a_dict():
    """Policies are engine.specs.PolicySpec records (conf/policy's defaults filled by pipeline.config.policy_spec),
    never dict literals."""
    from engine.core.policies import POLICIES

    literal = re.compile(r'\{\s*"name":\s*"(' + "|".join(POLICIES) + ')"')
    found = [str(p.relative_to(ROOT)) for p in python_files("engine", "pipeline", "servers", "tests")
             if literal.search(p.read_text())]
    assert not found, f"a policy written as a dict: {found}"


CSRC = ROOT / "engine" / "kernels" / "csrc"
MAX_NATIVE_LINES = 400
VECTOR_LAYER = ("vec_avx512.h", "vec_avx2.h", "vec_scalar.h")  # the only sources that name an instruction set
ISA_NAMES = re.compile(r"(?<![\w\"#])_mm(256|512)?_\w+|\b__m(128|256|512)\w*|immintrin\.h|CPU_CAPABILITY|at::vec\b")


def native_sources() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def test_every_native_source_is_short():
    long = {p.name: n for p in native_sources() if (n := len(p.read_text().splitlines())) > MAX_NATIVE_LINES}
    assert not long, f"native sources over {MAX_NATIVE_LINES} lines: {long}"


def test_only_the_vector_layer_names_an_instruction_set():
    """Intrinsics (_mm_*, _mm256_*, _mm512_*), their register types and header, and the build's CPU_CAPABILITY tests
    appear in vec_avx512.h, vec_avx2.h and vec_scalar.h alone, and ATen's vector type (at::vec) nowhere: every kernel
    uses their operations."""
    named = {p.name: sorted({m.group(0) for m in ISA_NAMES.finditer(p.read_text())})[:5] for p in native_sources()
             if p.name not in VECTOR_LAYER}
    assert not {k: v for k, v in named.items() if v}, named
    assert all((CSRC / f).exists() for f in VECTOR_LAYER)
