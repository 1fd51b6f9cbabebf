#!/usr/bin/env python3
"""The ABI of libhpshard against the baseline of its major version's first release.

The baseline (libhpshard-<version>.abi) is abidw's dump of that release's library, kept in
the repository. This test dumps the library just built the same way and compares the two
with abidiff (Debian abigail-tools): added functions pass; a removed function, a changed
signature, a changed type, or another SONAME fails. The ABI-extensible structs may only
gain fields at their end: abidiff cannot tell that from other changes of a struct, so they
are left out of its comparison (extensible-structs.suppr) and checked here, field by field
(the baseline's fields must be an unchanged prefix). The test also shows that both
comparisons can fail: a copy of the current dump with a function removed, and one with an
extensible struct's field retyped, must each be reported.

Usage: abi_check.py --library LIB --source-dir SRC --generated-dir GEN --work-dir DIR
"""
import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
BASELINE = HERE / "libhpshard-0.1.0.abi"
SUPPRESSIONS = HERE / "extensible-structs.suppr"
EXTENSIBLE = ("hps_device_properties", "hps_rendezvous_info", "hps_comm_options",
              "hps_clip_options", "hps_engine_options")

# abidiff's exit status bit for an incompatible change (a removed symbol).
ABIDIFF_INCOMPATIBLE = 8


def dump(library: pathlib.Path, source_dir: pathlib.Path, generated_dir: pathlib.Path,
         out: pathlib.Path) -> None:
    """abidw of the public interface only: types declared in the installed headers; the
    handles stay opaque. The debug info names headers by absolute path, or relative to the
    build directory (ccache's CCACHE_BASEDIR): both spellings are given, from there."""
    build_dir = library.parent.parent
    headers = [source_dir / "capi" / "include" / "hpshard", generated_dir / "hpshard"]
    args = ["abidw", "--no-corpus-path", "--no-comp-dir-path", "--no-show-locs",
            "--exported-interfaces-only", "--drop-private-types", "--out-file", str(out)]
    for h in headers:
        args += ["--headers-dir", str(h), "--headers-dir", os.path.relpath(h, build_dir)]
    subprocess.run(args + [str(library)], check=True, cwd=build_dir)


def abidiff(old: pathlib.Path, new: pathlib.Path) -> tuple[int, str]:
    r = subprocess.run(["abidiff", "--no-added-syms", "--suppressions", str(SUPPRESSIONS),
                        str(old), str(new)], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def type_names(root: ET.Element) -> dict:
    """type-id -> a C spelling of the type (typedef names kept as written)."""
    nodes = {e.get("id"): e for e in root.iter() if e.get("id")}
    names: dict = {}

    def name(type_id: str) -> str:
        if type_id in names:
            return names[type_id]
        e = nodes.get(type_id)
        if e is None:
            return f"<{type_id}>"
        tag = e.tag
        if tag in ("type-decl", "typedef-decl"):
            text = e.get("name")
        elif tag == "class-decl":
            text = "struct " + e.get("name", "?")
        elif tag == "enum-decl":
            text = "enum " + e.get("name", "?")
        elif tag == "pointer-type-def":
            text = name(e.get("type-id")) + "*"
        elif tag == "qualified-type-def":
            text = ("const " if e.get("const") == "yes" else "") + name(e.get("type-id"))
        elif tag == "array-type-def":
            dims = "".join(f"[{s.get('length')}]" for s in e.findall("subrange"))
            text = name(e.get("type-id")) + dims
        else:
            text = tag
        names[type_id] = text
        return text

    return {type_id: name(type_id) for type_id in nodes}


def struct_layouts(abi_xml: str) -> dict:
    """For each extensible struct: (size in bits, [(field, type, offset in bits), ...])."""
    root = ET.fromstring(abi_xml)
    names = type_names(root)
    layouts = {}
    for c in root.iter("class-decl"):
        if c.get("name") in EXTENSIBLE and c.get("is-declaration-only") != "yes":
            fields = []
            for m in c.findall("data-member"):
                v = m.find("var-decl")
                fields.append((v.get("name"), names.get(v.get("type-id")),
                               int(m.get("layout-offset-in-bits"))))
            layouts[c.get("name")] = (int(c.get("size-in-bits")), fields)
    return layouts


def extensible_problems(baseline_xml: str, current_xml: str) -> list:
    """Each extensible struct of the baseline: its fields, unchanged, start the current one."""
    base, cur = struct_layouts(baseline_xml), struct_layouts(current_xml)
    problems = []
    for struct in EXTENSIBLE:
        if struct not in base:
            problems.append(f"{struct} is missing from the baseline dump")
            continue
        if struct not in cur:
            problems.append(f"{struct} is missing from the built library's interface")
            continue
        (base_size, base_fields), (cur_size, cur_fields) = base[struct], cur[struct]
        if cur_fields[:len(base_fields)] != base_fields:
            problems.append(f"{struct}: the first release's fields {base_fields} are not an "
                            f"unchanged prefix of {cur_fields}")
        if cur_size < base_size:
            problems.append(f"{struct} shrank from {base_size} to {cur_size} bits")
    return problems


def soname(abi_xml: str) -> str:
    m = re.search(r"<abi-corpus [^>]*soname='([^']*)'", abi_xml)
    return m.group(1) if m else ""


def without_function(abi_xml: str, name: str) -> str:
    """The dump with function `name` removed (its symbol and its declaration)."""
    out = re.sub(rf"\s*<elf-symbol name='{name}'[^>]*/>", "", abi_xml, count=1)
    out, n = re.subn(rf"\s*<function-decl name='{name}'.*?</function-decl>", "", out, count=1,
                     flags=re.S)
    assert n == 1, f"no function-decl {name} in the dump"
    return out


def with_member_retyped(abi_xml: str, struct: str, member: str, to_type: str) -> str:
    """The dump with `struct`'s data member `member` given the type named `to_type`."""
    type_id = re.search(rf"<type-decl name='{re.escape(to_type)}'[^>]*id='([^']+)'", abi_xml)
    assert type_id, f"no type {to_type} in the dump"
    start = abi_xml.index(f"<class-decl name='{struct}'")
    end = abi_xml.index("</class-decl>", start)
    body, n = re.subn(rf"(<var-decl name='{member}' type-id=')[^']+'",
                      rf"\g<1>{type_id.group(1)}'", abi_xml[start:end], count=1)
    assert n == 1, f"no member {member} in {struct}"
    return abi_xml[:start] + body + abi_xml[end:]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--library", required=True, type=pathlib.Path)
    ap.add_argument("--source-dir", required=True, type=pathlib.Path)
    ap.add_argument("--generated-dir", required=True, type=pathlib.Path)
    ap.add_argument("--work-dir", required=True, type=pathlib.Path)
    args = ap.parse_args()
    for tool in ("abidw", "abidiff"):
        if shutil.which(tool) is None:
            print(f"abi_check: {tool} not found (apt-get install abigail-tools)")
            return 1
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    current = work / "libhpshard-current.abi"
    dump(args.library.resolve(), args.source_dir.resolve(), args.generated_dir.resolve(), current)
    current_xml = current.read_text()
    baseline_xml = BASELINE.read_text()

    problems = []
    if soname(current_xml) != soname(baseline_xml):
        problems.append(f"SONAME {soname(current_xml)!r} differs from the baseline's "
                        f"{soname(baseline_xml)!r}: a new major version needs its own "
                        f"baseline (README, 'ABI and SONAME policy')")
    rc, report = abidiff(BASELINE, current)
    print(f"== abidiff {BASELINE.name} (baseline) vs the built library: exit {rc}")
    print(report)
    if rc != 0:
        problems.append("the built library is not ABI compatible with the baseline "
                        "(removed or changed functions or types; see the report above)")
    problems += extensible_problems(baseline_xml, current_xml)
    for struct, (size, fields) in sorted(struct_layouts(current_xml).items()):
        grown = len(fields) - len(struct_layouts(baseline_xml).get(struct, (0, []))[1])
        print(f"   {struct}: {size // 8} bytes, {len(fields)} fields ({grown} appended)")

    # The comparison must be able to fail.
    removed = work / "libhpshard-removed.abi"
    removed.write_text(without_function(current_xml, "hps_comm_rank"))
    rc, report = abidiff(current, removed)
    if not rc & ABIDIFF_INCOMPATIBLE or "hps_comm_rank" not in report:
        problems.append(f"abidiff did not report a removed function (exit {rc}):\n{report}")
    retyped = with_member_retyped(current_xml, "hps_clip_options", "max_norm", "int")
    found = extensible_problems(current_xml, retyped)
    if not any("max_norm" in p for p in found):
        problems.append(f"a retyped field of an extensible struct was not reported: {found}")

    if problems:
        print("\n".join(f"abi_check: {p}" for p in problems))
        return 1
    print(f"abi_check: compatible with {BASELINE.name} ({soname(current_xml)}); "
          "a removal and a type change are detected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
