"""Reading lmlab's typed config schema: field names and types, and the comments that document fields.

A field is documented by the trailing comment on its line in the dataclass,
`max_steps: int = 300  # optimizer steps`; `field_comments` reads those back from the source, so
the documentation lives in one place and `lmlab list` shows it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize

from omegaconf import OmegaConf


def type_name(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def schema_fields(node) -> dict[str, dataclasses.Field] | None:
    """The fields of a structured config node's dataclass by name; None for a node without a schema."""
    schema = OmegaConf.get_type(node)
    return {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the trailing comment of its line, over `cls` and its dataclass bases (a subclass's wins)."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            comments.update(_own_field_comments(klass))
    return comments


def _own_field_comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # made at run time (make_dataclass, exec): there is no source to read
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    comments: dict[str, str] = {}
    above: list[str] = []  # the comment lines just above the next statement: a field's, if its line has none
    depth, at_statement_start, field_name, previous = 0, True, None, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.INDENT, tokenize.DEDENT):
            depth += 1 if tok.type == tokenize.INDENT else -1
        elif tok.type == tokenize.NEWLINE:  # the end of a statement, which may span lines
            at_statement_start, field_name = True, None
        elif tok.type == tokenize.COMMENT:
            if field_name:
                comments[field_name] = tok.string.lstrip("#").strip()  # its own line's comment wins
            elif at_statement_start:
                above.append(tok.string.lstrip("#").strip())
        elif tok.type == tokenize.NL:
            if previous is None or previous.type != tokenize.COMMENT:  # a blank line parts a comment from a field
                above.clear()
        elif at_statement_start:
            at_statement_start = False
            # A field is a statement of the class body (depth 1, not inside a method) that starts with its name.
            field_name = tok.string if depth == 1 and tok.type == tokenize.NAME and tok.string in names else None
            if field_name and above:
                comments[field_name] = " ".join(above)
            above = []
        previous = tok
    return comments
