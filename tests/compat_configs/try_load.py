"""Try loading the third-party sample configs in this folder as odl online (Kafka) configs.

Not a test: a report. For each ``easyrec/*.config`` and ``torcheasyrec/*.config`` it

1. points its input at a local broker, editing nothing else: a config with
   ``kafka_train_input`` / ``kafka_eval_input`` keeps them with each ``server`` set to
   ``127.0.0.1:9092``; any other gets ``kafka_train_input { server: "127.0.0.1:9092"
   topic: "t" group: "g" }`` in place of its top-level ``train_input_path``,
   ``eval_input_path`` and ``*_train_input`` / ``*_eval_input`` blocks;
2. loads it like ``odl-train`` does (:func:`odl.config.pipeline_config.load_pipeline_config`
   on a temporary file; a config without ``model_dir`` gets one as ``--model_dir`` gives it,
   EasyRec's scripts passing theirs on the command line) and runs
   :func:`odl.models.model_registry.check_pipeline_config` with ``online=True``;
3. prints one line per file (file, model class, OK or the error) and the OK count.

Run from the repository root: ``.venv/bin/python tests/compat_configs/try_load.py``
(``-v`` also prints, on stderr, the fields removed by the rewrite and every error of a file
that has several).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from odl.config.config_error import ConfigError  # noqa: E402
from odl.config.pipeline_config import load_pipeline_config  # noqa: E402
from odl.models.model_registry import check_pipeline_config  # noqa: E402

KAFKA_SECTIONS = ("kafka_train_input", "kafka_eval_input")
KAFKA_INPUT = '\nkafka_train_input {\n  server: "127.0.0.1:9092"\n  topic: "t"\n  group: "g"\n}\n'

# TorchEasyRec names the model by its message inside model_config
TZREC_MODEL_MESSAGES = {
    "deepfm": "DeepFM", "wide_and_deep": "WideAndDeep", "multi_tower": "MultiTower",
    "multi_tower_din": "MultiTowerDIN", "dbmtl": "DBMTL", "mmoe": "MMoE", "dcn": "DCN",
    "dcn_v2": "DCNV2", "dlrm": "DLRM", "ple": "PLE", "rank_model": "RankModel",
    "mask_net": "MaskNet", "wukong": "WuKong", "rocket_launching": "RocketLaunching",
    "pepnet": "PEPNet",
}


# --- a small protobuf text-format scanner: enough to find fields and their spans -----------

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<str>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<punct>[{}\[\]:,;<>])
  | (?P<word>[^\s{}\[\]:,;<>"'\#]+)
""", re.VERBOSE)


@dataclass
class Tok:
    kind: str
    text: str
    start: int
    end: int


@dataclass
class Field:
    path: str      # dotted path of the enclosing message ("" at top level)
    name: str
    start: int     # offset of the field name
    end: int       # offset after the value (and a trailing , or ;)
    value: str     # scalar text, "" for a message or list


def tokenize(text: str) -> list[Tok]:
    toks = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:  # stray character: make it a word so the scan goes on
            toks.append(Tok("word", text[pos], pos, pos + 1))
            pos += 1
            continue
        if m.lastgroup not in ("ws", "comment"):
            toks.append(Tok(m.lastgroup, m.group(), m.start(), m.end()))
        pos = m.end()
    return toks


def scan_fields(text: str) -> list[Field]:
    """Every field of the text, nested ones included, in order."""
    toks = tokenize(text)
    fields: list[Field] = []

    def skip_value(i: int) -> int:
        """Index after the value starting at toks[i] (message, list or scalar)."""
        t = toks[i]
        if t.text in ("{", "<"):
            return i  # handled by the caller
        if t.text == "[":
            depth = 0
            while i < len(toks):
                if toks[i].text in ("[", "{", "<"):
                    depth += 1
                elif toks[i].text in ("]", "}", ">"):
                    depth -= 1
                    if depth == 0:
                        return i + 1
                i += 1
            return i
        if t.kind == "str":
            while i < len(toks) and toks[i].kind == "str":  # "a" "b" concatenation
                i += 1
            return i
        if t.text == "-" and i + 1 < len(toks):
            return i + 2
        return i + 1

    def message(i: int, path: str, close: str | None) -> int:
        while i < len(toks):
            t = toks[i]
            if close is not None and t.text == close:
                return i + 1
            if t.kind != "word" and t.text != "[":  # stray token
                i += 1
                continue
            if t.text == "[":  # extension / Any name: [type.googleapis.com/x]
                while i < len(toks) and toks[i].text != "]":
                    i += 1
            name_tok = t
            i += 1
            if i < len(toks) and toks[i].text == ":":
                i += 1
            if i >= len(toks):
                break
            sub = join(path, name_tok.text)
            if toks[i].text in ("{", "<"):
                end_char = "}" if toks[i].text == "{" else ">"
                i = message(i + 1, sub, end_char)
                value = ""
            elif toks[i].text == "[" and i + 1 < len(toks) and toks[i + 1].text in ("{", "<"):
                # list of messages
                i += 1
                while i < len(toks) and toks[i].text != "]":
                    if toks[i].text in ("{", "<"):
                        i = message(i + 1, sub, "}" if toks[i].text == "{" else ">")
                    else:
                        i += 1
                i += 1
                value = ""
            else:
                j = skip_value(i)
                value = text[toks[i].start:toks[j - 1].end] if j > i else ""
                i = j
            if i < len(toks) and toks[i].text in (",", ";"):
                i += 1
            end = toks[i - 1].end
            fields.append(Field(path, name_tok.text, name_tok.start, end, value))
        return i

    message(0, "", None)
    return fields


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# --- the rewrite -----------------------------------------------------------------------------

def to_kafka_input(text: str, flavor: str) -> tuple[str, list[str]]:
    """The text with its input pointed at the broker; and what was changed.

    A config that reads Kafka already (``kafka_train_input`` / ``kafka_eval_input``) keeps its
    sections, topics, groups and offsets: only each ``server`` becomes the local broker. Any
    other config gets ``kafka_train_input`` in place of its input sections. Nothing else
    changes (``data_config.input_type`` stays: odl reads it as informational).
    """
    fields = scan_fields(text)
    kafka = {f.name for f in fields if f.path == "" and f.name in KAFKA_SECTIONS}
    spans = []
    for f in fields:
        if kafka and f.path in kafka and f.name == "server":
            spans.append((f.start, f.end, join(f.path, f.name), 'server: "127.0.0.1:9092"\n'))
        elif f.path == "" and f.name not in kafka and (
                f.name in ("train_input_path", "eval_input_path")
                or f.name.endswith("_train_input") or f.name.endswith("_eval_input")):
            spans.append((f.start, f.end, join(f.path, f.name), ""))
    out = []
    pos = 0
    for start, end, _, replacement in sorted(spans):
        out.append(text[pos:start] + replacement)
        pos = end
    out.append(text[pos:])
    tail = "" if kafka else KAFKA_INPUT
    return "".join(out).rstrip() + "\n" + tail, [s[2] for s in sorted(spans)]


def model_class_of(text: str) -> str:
    fields = scan_fields(text)
    for f in fields:
        if f.path == "model_config" and f.name == "model_class":
            return f.value.strip("\"'")
    for f in fields:
        if f.path == "model_config" and f.name in TZREC_MODEL_MESSAGES:
            return TZREC_MODEL_MESSAGES[f.name] + " (msg)"
    return "?"


def corpus_files(flavor: str) -> list[str]:
    """The sample configs of ``flavor`` (``easyrec`` or ``torcheasyrec``), sorted by name.

    Hidden files (:func:`load_one`'s rewritten copies, present while one loads) are not
    samples.
    """
    return sorted(name for name in os.listdir(os.path.join(HERE, flavor))
                  if name.endswith(".config") and not name.startswith("."))


def load_one(path: str, flavor: str, verbose: bool = False):
    """The sample config at ``path`` with a Kafka input, loaded and validated as odl-train does.

    Raises:
        ConfigError: what odl-train would refuse.
    """
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    new_text, removed = to_kafka_input(text, flavor)
    if verbose:
        print(f"  {os.path.basename(path)}: removed {removed}", file=sys.stderr)
    # beside the sample, so that the files it names by a relative path (fg_json_path,
    # vocab_file) resolve as they do for the sample itself; hidden (a leading dot), so that
    # a listing of the corpus made meanwhile (another test worker's) does not take it
    fd, tmp = tempfile.mkstemp(suffix=".config", prefix=".compat_",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(new_text)
        # a config without model_dir (or with an empty one) is run with odl-train's
        # --model_dir, as EasyRec's and TorchEasyRec's scripts pass theirs on the command line
        has_dir = re.search(r'^\s*model_dir\s*:\s*"[^"]+"', text, re.M) is not None
        config = load_pipeline_config(tmp, model_dir=None if has_dir else "model_dir")
        check_pipeline_config(config, online=True)
        return config
    finally:
        os.unlink(tmp)


_TMP_NAME = re.compile(r"\S*compat_[^\s:]*\.config")


def try_one(path: str, flavor: str, verbose: bool) -> tuple[str, str, bool]:
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    model_class = model_class_of(text)
    try:
        load_one(path, flavor, verbose)
        return model_class, "OK", True
    except ConfigError as e:
        # ConfigErrors (a ConfigError subclass, where the loader has one) carries every
        # problem of the file in .errors; the row shows the first and counts the rest
        errors = getattr(e, "errors", None) or [e]
        lines = [_TMP_NAME.sub("<file>", f"[{x.field}] {x.message}") for x in errors]
        more = f" (+{len(lines) - 1} more)" if len(lines) > 1 else ""
        if verbose and len(lines) > 1:
            print("\n".join(f"    {line}" for line in lines), file=sys.stderr)
        return model_class, f"ConfigError {lines[0]}{more}", False
    except Exception as e:  # noqa: BLE001 - a report, not a test: show anything
        return model_class, _TMP_NAME.sub("<file>", f"{type(e).__name__} (not ConfigError): {e}"), \
            False


def main() -> int:
    verbose = "-v" in sys.argv[1:]
    rows = []
    for flavor in ("easyrec", "torcheasyrec"):
        folder = os.path.join(HERE, flavor)
        for name in corpus_files(flavor):
            mc, result, ok = try_one(os.path.join(folder, name), flavor, verbose)
            rows.append((f"{flavor}/{name}", mc, result.replace("\n", " "), ok))
    w1 = max(len(r[0]) for r in rows)
    w2 = max(len(r[1]) for r in rows)
    print(f"{'file':<{w1}}  {'model class':<{w2}}  result")
    for file, mc, result, _ in rows:
        print(f"{file:<{w1}}  {mc:<{w2}}  {result}")
    n_ok = sum(r[3] for r in rows)
    print(f"\nOK {n_ok} / {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
