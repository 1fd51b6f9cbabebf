#!/usr/bin/env python3
"""Fails when a function declared in hpshard.h lacks a binding in Python, Java or Rust.

Python and Java: bindings/swig/hpshard.i wraps each C function as a method of a handle
class (or a module function, or under its C name); the generated layer must have that
member, and the hand-written layer must call it. Rust: the generated hpshard-sys must
declare the function, and the safe crate must call it (sys::hps_...).
"""
import argparse
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import swig_map  # noqa: E402


def text_of(paths) -> str:
    return "\n".join(p.read_text(errors="replace") for p in paths)


def python_problems(functions, wrapped, generated: pathlib.Path, layer: str) -> list:
    gen = generated.read_text()
    classes = {m.group(1): m.start() for m in re.finditer(r"^class (\w+)\(", gen, re.M)}
    problems = []
    for f in functions:
        ok_gen = ok_layer = False
        for cls, member in wrapped.get(f, []):
            if cls is None:
                ok_gen |= re.search(rf"^def {member}\(", gen, re.M) is not None
                ok_layer |= f"_c.{member}(" in layer
            elif member == "~":
                ok_gen |= cls in classes
                ok_layer |= "__swig_destroy__" in layer
            else:
                start = classes.get(cls)
                if start is None:
                    continue
                end = min([s for s in classes.values() if s > start] + [len(gen)])
                ok_gen |= f"    def {member}(" in gen[start:end]
                ok_layer |= f".{member}(" in layer
        if not ok_gen:
            problems.append(f"python: {f} is not wrapped in {generated.name} (hpshard.i)")
        elif not ok_layer:
            problems.append(f"python: {f} is wrapped but the hand-written layer never calls it")
    return problems


def java_problems(functions, wrapped, generated_dir: pathlib.Path, layer: str) -> list:
    problems = []
    for f in functions:
        ok_gen = ok_layer = False
        for cls, member in wrapped.get(f, []):
            source = generated_dir / f"{cls or 'HpshardNative'}.java"
            if not source.exists():
                continue
            gen = source.read_text()
            if member == "~":
                ok_gen |= "public synchronized void delete()" in gen
                ok_layer |= f"{cls}::delete" in layer or ".delete()" in layer
                continue
            name = member if member.startswith("hps_") else swig_map.camel(member)
            if cls == "WorkHandle" and member == "wait":
                name = "await"  # java.i: Object.wait() is final
            ok_gen |= re.search(rf"public (static )?[\w\[\].]+ {name}\(", gen) is not None
            ok_layer |= f".{name}(" in layer
        if not ok_gen:
            problems.append(f"java: {f} is not wrapped in {generated_dir} (hpshard.i)")
        elif not ok_layer:
            problems.append(f"java: {f} is wrapped but the hand-written layer never calls it")
    return problems


def rust_problems(functions, generated: pathlib.Path, layer: str) -> list:
    gen = generated.read_text()
    problems = []
    for f in functions:
        if not re.search(rf"pub fn {f}\(", gen):
            problems.append(f"rust: {f} is not declared in {generated.name} (regenerate.sh)")
        elif not re.search(rf"\bsys::{f}\b|=\s*{f}\(", layer):  # or a collectives! entry
            problems.append(f"rust: {f} is declared but the safe crate never calls it")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--header", required=True, type=pathlib.Path)
    ap.add_argument("--python-generated", type=pathlib.Path)
    ap.add_argument("--python-layer", type=pathlib.Path, nargs="*", default=[])
    ap.add_argument("--java-generated-dir", type=pathlib.Path)
    ap.add_argument("--java-layer", type=pathlib.Path, nargs="*", default=[])
    ap.add_argument("--rust-generated", type=pathlib.Path)
    ap.add_argument("--rust-layer", type=pathlib.Path, nargs="*", default=[])
    args = ap.parse_args()

    functions = swig_map.header_functions(args.header)
    if not functions:
        sys.exit(f"parity: no HPS_API functions found in {args.header}")
    wrapped = swig_map.binding_map()
    problems = []
    for f in functions:
        if f not in wrapped:
            problems.append(f"python+java: {f} is not wrapped by bindings/swig/hpshard.i")
    checked = []
    for language, generated in (("python", args.python_generated),
                                ("java", args.java_generated_dir),
                                ("rust", args.rust_generated)):
        if generated is None or not generated.exists():
            problems.append(f"{language}: generated layer {generated} missing (build first)")
            continue
        layer = text_of(getattr(args, f"{language}_layer"))
        if language == "python":
            problems += python_problems(functions, wrapped, generated, layer)
        elif language == "java":
            problems += java_problems(functions, wrapped, generated, layer)
        else:
            problems += rust_problems(functions, generated, layer)
        checked.append(language)

    if problems:
        print("\n".join(problems))
        print(f"parity: {len(problems)} problem(s) over {len(functions)} C functions")
        return 1
    print(f"parity: all {len(functions)} C functions bound in {', '.join(checked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
