"""Requests of many kinds for self-distillation (issue 49), and requests the target writes itself.

A head trained on the topic templates of prompts.py alone drafts worse for requests of other kinds
(poems, recipes, emails, code, plans): each kind of request has its own kind of answer. `KINDS`
phrases several dozen kinds of request about any subject; `HELDOUT_KINDS`, kinds no template of
prompts.py resembles either, are held out whole (`kind_prompts("heldout")`), so the head's agreement
can be measured on kinds it never saw as well as on subjects it never saw (prompts.py's split;
held-out kinds are asked about training subjects only).

`writing_prompts` asks the target for more requests by completion: a list of requests of training
kinds, open at its end, which the target continues with one of its own (`parse_written` keeps the
lines that read as a request). The instruct model asked in chat to write a request answers it
instead, or refuses; continuing a list it does often enough to be worth it.
"""
from __future__ import annotations

import random
import re

from pipespec.train.prompts import SKILLS, TOPICS, held_out

# kind -> phrasings, each with one subject slot
KINDS = {
    "poem": ["Compose a poem about {}.", "Can you write a few lines of verse about {}?",
             "I need a short rhyming poem about {} for a card."],
    "song": ["Write the lyrics of a short song about {}.", "Write a chorus for a song about {}."],
    "story": ["Tell me a short story about {}.", "Write a bedtime story that involves {}.",
              "Write the opening paragraph of a novel about {}."],
    "email": ["Write an email to a friend telling them about {}.", "Draft a short email to my team about {}.",
              "Help me write a message to my neighbour about {}."],
    "letter": ["Write a letter to the editor of a local newspaper about {}.",
               "Write a formal letter asking for information about {}."],
    "recipe": ["Invent a dish inspired by {} and give the recipe.", "Suggest a snack to eat while learning about {}.",
               "What would a menu themed on {} look like?"],
    "child": ["How would you explain {} to a six-year-old?", "Explain {} to a kid using a simple example.",
              "My daughter asked me about {}. How do I explain it?"],
    "analogy": ["Explain {} with an analogy.", "What is a good metaphor for {}?"],
    "code": ["Write a Python program that has something to do with {}.",
             "Write a small JavaScript function for a website about {}.",
             "Design a database table to store information about {}, in SQL."],
    "joke": ["Do you know a good joke about {}?", "Make up a pun about {}.", "Write a funny one-liner about {}."],
    "riddle": ["Write a riddle whose answer is {}.", "Give me a brain teaser that involves {}."],
    "plan": ["Make a plan for a weekend devoted to {}.", "Plan a school project about {}.",
             "Make a 30-day challenge about {}."],
    "advice": ["I want to get better at understanding {}. Any advice?",
               "My friend is obsessed with {}. How can I share the interest?",
               "What should I know before I spend money on {}?"],
    "list": ["List ten ideas related to {}.", "Give me a checklist for a day about {}.",
             "Brainstorm names for a club about {}."],
    "compare": ["Compare {} with something similar.", "What are the differences between {} today and 100 years ago?"],
    "debate": ["Give arguments for and against {}.", "Write both sides of a debate about {}."],
    "summary": ["Summarize what everyone should know about {} in five bullet points.",
                "Give me a one-paragraph summary of {}."],
    "describe": ["Describe {} to someone who has never seen it.", "Write a vivid description of {}.",
                 "Describe a day in the life of someone who works with {}."],
    "dialogue": ["Write a dialogue between two friends about {}.",
                 "Write a short scene where a teacher and a student talk about {}."],
    "interview": ["Write five interview questions for an expert on {}.",
                  "Write a short interview with a person who loves {}."],
    "quiz": ["Write a five-question quiz about {}, with answers.",
             "Give me three true-or-false questions about {}."],
    "speech": ["Write a short speech about {} for a school assembly.",
               "Write a toast that mentions {}."],
    "ad": ["Write an advertisement for a product related to {}.", "Write a slogan for a campaign about {}."],
    "review": ["Write a review of a book about {}.", "Write a short review of a museum exhibit on {}."],
    "social": ["Write a social media post about {}.", "Write a thread of three short posts about {}."],
    "instructions": ["Give step-by-step instructions for a simple experiment about {}.",
                     "Explain how to make a poster about {}, step by step."],
    "definition": ["Define {} in one sentence.", "What does the word {} mean? Give an example."],
    "history": ["Tell me how {} came to be.", "What are three turning points in the history of {}?"],
    "opinion": ["What do you think about {}?", "Is {} overrated? Give your honest view."],
    "facts": ["Tell me a surprising fact about {}.", "What are some fun facts about {} for a quiz night?"],
    "lesson": ["Write a lesson plan for teaching {} to teenagers.", "Outline a one-hour workshop on {}."],
    "faq": ["Write an FAQ about {} with four questions and answers.",
            "What questions do people often ask about {}? Answer them."],
    "motivation": ["Write a motivational message for someone who is learning about {}.",
                   "Write an encouraging note to a friend who is nervous about {}."],
    "table": ["Make a table with the pros and cons of {}.", "Make a table of key terms about {} and their meanings."],
    "outline": ["Write an outline for an essay about {}.", "Give me an outline for a presentation on {}."],
    "translate": ["How do you say {} in French and in Spanish?", "Translate 'I love {}' into three languages."],
}
HELDOUT_KINDS = ("song", "riddle", "debate", "table", "review", "speech", "analogy", "ad")

# second turns of a conversation (follow_up_conversations): what users say after an answer
FOLLOW_UPS = [
    "Can you make it shorter?", "Can you give me another example?", "Thanks! Can you explain that in more detail?",
    "Please rewrite it in a more formal tone.", "Now summarize that in two sentences.", "Can you turn that into a list?",
    "What would you add to that?", "Make it funnier, please.", "Can you explain the first point more?",
    "Thank you. One more, please.", "Is that really true? Why?", "Can you write it for a younger reader?",
    "What should I do next?", "Give me a title for that.", "Can you say it in simpler words?",
]


def kinds(split: str) -> list[str]:
    """The kinds of one split ("train" or "heldout")."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return [k for k in KINDS if (k in HELDOUT_KINDS) == (split == "heldout")]


def training_subjects() -> list[str]:
    """The subjects of prompts.py's training split (held-out kinds are asked about these too, so that
    the held-out-kind split measures the kind alone)."""
    return [s for s in TOPICS + SKILLS if not held_out(s)]


def kind_prompts(split: str, count: int | None = None, seed: int = 0) -> list[str]:
    """`count` (default: all) prompts of the split's kinds about training subjects, every kind in
    turn, in a seeded order."""
    rng = random.Random(seed)
    subjects = training_subjects()
    by_kind = []
    for kind in kinds(split):
        prompts = [p.format(s) for p in KINDS[kind] for s in subjects]
        rng.shuffle(prompts)
        by_kind.append(prompts)
    mixed = [ps[i] for i in range(max(map(len, by_kind))) for ps in by_kind if i < len(ps)]
    return mixed if count is None else mixed[:count]


def writing_prompts(count: int, examples: int = 4, seed: int = 0) -> list[str]:
    """`count` completion prompts (no chat template): a list of `examples` requests of training kinds,
    the next item open for the target to write."""
    rng = random.Random(seed)
    pool = kind_prompts("train", seed=seed)
    return ["Requests people typed into an AI assistant:\n" + "".join(f"- {p}\n" for p in rng.sample(pool, examples))
            + "-" for _ in range(count)]


_REQUEST = re.compile(r"[A-Z][^\n]{14,198}[.?!]")


def parse_written(text: str) -> str | None:
    """The request in the target's continuation of a list, or None: its first line, if that reads as
    one sentence or more (a capital first, 16-200 characters, ending in . ? or !)."""
    line = text.split("\n", 1)[0].strip().strip('"')
    return line if _REQUEST.fullmatch(line) else None


def follow_up_conversations(pairs: list[tuple[str, str]], seed: int = 0) -> list[list[dict]]:
    """Two-turn conversations: each (request, answer) followed by a user turn from FOLLOW_UPS."""
    rng = random.Random(seed)
    return [[{"role": "user", "content": q}, {"role": "assistant", "content": a},
             {"role": "user", "content": rng.choice(FOLLOW_UPS)}] for q, a in pairs]
