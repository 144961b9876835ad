"""Questions with exact answers about synthetic scenes, for a VLM (task=vlm): colour, shape, count, position.

    QUESTIONS["colour"].ask(Scene("circle", "red", "top left", count=2))  == ("what colour are the shapes?", "red")

Each item is one scene with one question; the image is rendered from the scene, so the answer is known.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lmlab.errors import ConfigError
from lmlab.multimodal.synthetic import COUNTS, Scene, random_scenes, render, to_tensor

NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


@dataclass(frozen=True)
class Question:
    text: str
    answer: Callable[[Scene], str]

    def ask(self, scene: Scene) -> tuple[str, str]:
        return self.text, self.answer(scene)


QUESTIONS: dict[str, Question] = {
    "colour": Question("what colour is the shape?", lambda s: s.color),
    "shape": Question("what shape is it?", lambda s: s.shape),
    "count": Question("how many shapes are there?", lambda s: NUMBER_WORDS[s.count]),
    "position": Question("where is it?", lambda s: s.position),
}


def check_question_types(types: Sequence[str]) -> list[str]:
    """The types, each known, none twice; one clear error otherwise."""
    unknown = [t for t in types if t not in QUESTIONS]
    if unknown or not types or len(set(types)) != len(types):
        raise ConfigError(f"task.questions={list(types)}: pick distinct question types from {', '.join(QUESTIONS)}")
    return list(types)


@dataclass(frozen=True)
class QAItem:
    scene: Scene
    kind: str  # the question type
    question: str
    answer: str


def qa_items(n: int, seed: int, types: Sequence[str], counts: Sequence[int] = COUNTS) -> list[QAItem]:
    """`n` seeded scenes (shapes only, no glyphs), each asked one question of a type drawn uniformly from `types`."""
    rng = random.Random(seed)
    items = []
    for scene in random_scenes(n, seed, counts=counts):
        kind = rng.choice(list(types))
        question, answer = QUESTIONS[kind].ask(scene)
        items.append(QAItem(scene, kind, question, answer))
    return items


class SceneQA(torch.utils.data.Dataset):
    """QA items with their images rendered (the same jittered image for an index every epoch): each item is
    {"image": FloatTensor[3, size, size] in [0, 1], "question", "answer", "kind"}."""

    def __init__(self, items: Sequence[QAItem], size: int, seed: int):
        self.items, self.size, self.seed = list(items), size, seed

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        item = self.items[index]
        image = render(item.scene, self.size, random.Random(self.seed * 1_000_003 + index))
        return {"image": to_tensor(image), "question": item.question, "answer": item.answer, "kind": item.kind}
