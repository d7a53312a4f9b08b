"""Convert a multiple-choice data set saved locally (Hugging Face `datasets`: a save_to_disk directory,
or JSON/JSONL/Parquet files) to ddptrain's task JSONL ({"context", "choices", "label"} a line),
with lm-evaluation-harness's prompts for the tasks it names:

    python scripts/task_jsonl.py arc_easy  ~/data/ai2_arc_easy_test   tasks/arc_easy.jsonl
    python scripts/task_jsonl.py hellaswag ~/data/hellaswag/validation tasks/hellaswag.jsonl
    python scripts/task_jsonl.py mmlu      ~/data/mmlu_all_test       tasks/mmlu.jsonl
    python scripts/task_jsonl.py fields    DATA OUT --context question --choices options --label answer

`arc_easy`/`arc_challenge`, `hellaswag` and `mmlu` follow the harness's doc_to_text and doc_to_choice
for those tasks (zero-shot, target delimiter " "); `fields` copies three columns as they are. Nothing
is downloaded: save the split first (`datasets.load_dataset(...).save_to_disk(DIR)` where a network is).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def _hellaswag_text(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)  # the harness's preprocess: WikiHow's bracketed artifacts
    return text.replace("  ", " ")


def arc(doc: dict) -> dict:
    return {"context": f"Question: {doc['question']}\nAnswer:", "choices": list(doc["choices"]["text"]),
            "label": list(doc["choices"]["label"]).index(doc["answerKey"])}


def hellaswag(doc: dict) -> dict:
    context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {"context": _hellaswag_text(doc["activity_label"] + ": " + context),
            "choices": [_hellaswag_text(ending) for ending in doc["endings"]], "label": int(doc["label"])}


def mmlu(doc: dict) -> dict:
    letters = "ABCD"
    lines = [doc["question"].strip(), *(f"{letter}. {choice}" for letter, choice in zip(letters, doc["choices"]))]
    return {"context": "\n".join(lines) + "\nAnswer:", "choices": list(letters), "label": int(doc["answer"])}


PRESETS = {"arc_easy": arc, "arc_challenge": arc, "hellaswag": hellaswag, "mmlu": mmlu}


def load_local(path: Path):
    """A saved split: a save_to_disk directory, or data files (.json, .jsonl, .parquet)."""
    import datasets

    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            raise SystemExit(f"{path} holds several splits ({', '.join(loaded)}): give one split's directory")
        return loaded
    kind = "parquet" if path.suffix == ".parquet" else "json"
    return datasets.load_dataset(kind, data_files=str(path), split="train")


def convert(rows, preset: str, fields: tuple[str, str, str] | None = None) -> list[dict]:
    if preset != "fields":
        return [PRESETS[preset](dict(row)) for row in rows]
    context, choices, label = fields
    return [{"context": row[context], "choices": list(row[choices]), "label": int(row[label])} for row in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", choices=[*PRESETS, "fields"])
    parser.add_argument("data", type=Path, help="a save_to_disk directory of one split, or a data file")
    parser.add_argument("out", type=Path, help="the task JSONL to write")
    parser.add_argument("--context", default="context")
    parser.add_argument("--choices", default="choices")
    parser.add_argument("--label", default="label")
    parser.add_argument("--limit", type=int, default=None, help="the first N items only")
    args = parser.parse_args(argv)
    rows = load_local(args.data)
    if args.limit is not None:
        rows = rows.select(range(min(args.limit, len(rows))))
    items = convert(rows, args.preset, (args.context, args.choices, args.label))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
    print(f"wrote {len(items)} items to {args.out}")


if __name__ == "__main__":
    main()
