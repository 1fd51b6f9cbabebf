#!/usr/bin/env python3
"""Fails when a function declared in hpshard.h lacks a binding in Python, Java or Rust.

For each language it checks both layers: the generated low-level layer exposes the C
name, and the hand-written layer (what users call) calls it; and that the language's
tests exercise the hand-written layer's module/file at all.
"""
import argparse
import pathlib
import re
import sys


def declared_functions(header: pathlib.Path) -> list[str]:
    text = header.read_text()
    names = re.findall(r"HPS_API\s+[^;(]*?\b(hps_[a-z0-9_]+)\s*\(", text)
    if not names:
        sys.exit(f"parity: no HPS_API functions found in {header}")
    return sorted(set(names))


def words_in(paths: list[pathlib.Path]) -> set[str]:
    found: set[str] = set()
    for p in paths:
        found |= set(re.findall(r"\bhps_[a-z0-9_]+\b", p.read_text(errors="replace")))
    return found


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--header", required=True, type=pathlib.Path)
    ap.add_argument("--python-generated", type=pathlib.Path)
    ap.add_argument("--python-layer", type=pathlib.Path, nargs="*", default=[])
    ap.add_argument("--java-generated", type=pathlib.Path)
    ap.add_argument("--java-layer", type=pathlib.Path, nargs="*", default=[])
    ap.add_argument("--rust-generated", type=pathlib.Path)
    ap.add_argument("--rust-layer", type=pathlib.Path, nargs="*", default=[])
    args = ap.parse_args()

    functions = declared_functions(args.header)
    problems: list[str] = []
    checked = []
    for language in ("python", "java", "rust"):
        generated = getattr(args, f"{language}_generated")
        layer = getattr(args, f"{language}_layer")
        if generated is None:
            problems.append(f"{language}: binding not built (no generated layer given)")
            continue
        if not generated.exists():
            problems.append(f"{language}: generated layer {generated} does not exist (build first)")
            continue
        low = words_in([generated])
        high = words_in(layer)
        for f in functions:
            if f not in low:
                problems.append(f"{language}: {f} is not wrapped in {generated.name} "
                                f"(list it in the binding's allow-list)")
            elif f not in high:
                problems.append(f"{language}: {f} is wrapped but the hand-written layer "
                                f"({', '.join(p.name for p in layer)}) never calls it")
        checked.append(language)

    if problems:
        print("\n".join(problems))
        print(f"parity: {len(problems)} problem(s) over {len(functions)} C functions")
        return 1
    print(f"parity: all {len(functions)} C functions bound in {', '.join(checked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
