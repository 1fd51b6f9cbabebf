"""Which SWIG binding wraps each C function: read from bindings/swig/hpshard.i.

hpshard.i exposes the C API as methods of handle classes (%extend CLASS { ... }), module
functions (%inline static functions) and a few functions under their C names
(%hps_expose hps_...). Every method or function body calls the C functions it wraps, so
the map is: C function -> [(class or None, member)], a destructor's member being "~".
Used by the parity test and the Python low-level tests.
"""
import pathlib
import re

SWIG_I = pathlib.Path(__file__).resolve().parents[2] / "bindings" / "swig" / "hpshard.i"

_C_CALL = re.compile(r"\b(hps_(?!swig_)[a-z0-9_]+)\s*\(")
_METHOD = re.compile(r"^\s*(?:static\s+)?(?:const\s+)?[\w]+\s*\**\s*(~?\w+)\s*\(")


def _blocks(text: str):
    """(class or None, member, body) for every %extend method and %inline function."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"%extend (\w+) \{", line)
        inline = line.strip() == "%inline %{"
        if not m and not inline:
            i += 1
            continue
        cls = m.group(1) if m else None
        end = "}" if m else "%}"
        i += 1
        current, body = None, []
        while i < len(lines) and lines[i].rstrip() != end:
            decl = lines[i]
            dm = re.match(r"^\s*~(\w+)\(\)", decl) if cls else None
            mm = _METHOD.match(decl) if (cls and decl.startswith("  ") and not
                                         decl.startswith("   ")) or (not cls and
                                                                     decl.startswith("static ")) \
                else None
            if dm or mm:
                if current:
                    yield cls, current, "\n".join(body)
                current, body = ("~" if dm else mm.group(1)), []
            body.append(decl)
            i += 1
        if current:
            yield cls, current, "\n".join(body)
        i += 1


def binding_map(text: str = None) -> dict:
    text = SWIG_I.read_text() if text is None else text
    found: dict = {}
    for cls, member, body in _blocks(text):
        for name in _C_CALL.findall(body):
            found.setdefault(name, []).append((cls, member))
    for name in re.findall(r"^%hps_expose (hps_[a-z0-9_]+);", text, re.M):
        found.setdefault(name, []).append((None, name))
    return found


def header_functions(header: pathlib.Path) -> list:
    names = re.findall(r"HPS_API\s+[^;(]*?\b(hps_[a-z0-9_]+)\s*\(", header.read_text())
    return sorted(set(names))


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)
