"""Synthetic tool selection with argument filling, answered as ReAct ``Action`` lines.

Each prompt lists 2-3 tools (3-4 with two calls) (compactly, ``name(arg, ...)``) and a request; the response names
the right tool and fills its argument. Copying alone saturates a tiny model, so with
probability `difficulty` the request targets a numeric tool whose argument must be *computed*
from the wording: a party of "two adults and three kids" -> 5 people, "2 hours 5 minutes" ->
125 minutes. Otherwise any tool is drawn and its argument is copied.
train / id: the request phrasings below.
ood_near: unseen phrasings of the same tools.
ood_mid:  values (cities, songs, names) never used in training.
ood_far:  two calls in one request.
compact: two cities, songs and people (ood_mid: one new of each) and one distractor tool
    instead of one or two.
"""

from __future__ import annotations

import json
import random

from megatron_sdpo.data.synthetic.base import NUMBER_WORDS, check_args, make_record, rng_for, sample_unique

DEFAULT_DIFFICULTY = 0.8
INSTRUCTION = "Reply with Action and Action Input."

TOOLS = {
    "get_weather": ("Weather for a city", {"city": "string"}),
    "set_timer": ("Start a timer", {"minutes": "integer"}),
    "play_song": ("Play a song", {"title": "string"}),
    "book_table": ("Book a restaurant table", {"people": "integer"}),
    "call_friend": ("Phone a contact", {"name": "string"}),
    "buy_tickets": ("Buy cinema tickets", {"count": "integer"}),
}
CITIES = ("Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Quito")
SONGS = ("Blue Sky", "Red Moon", "Sea Song", "Old Road", "Gold Rain", "Night Bus")
PEOPLE = ("Ann", "Bob", "Cara", "Dan", "Eve", "Finn", "Gus", "Hana")
NEW_CITIES = ("Lagos", "Perth", "Kyiv", "Baku")
NEW_SONGS = ("Green Door", "Slow Train", "Ice Town")
NEW_PEOPLE = ("Ivo", "Jade", "Kim", "Lou")

TRAIN_PHRASES = {
    "get_weather": ("What is the weather in {v}?", "Is it raining in {v}?"),
    "set_timer": ("Set a timer for {v}.", "Remind me in {v}."),
    "play_song": ("Play {v}.", "Put on the song {v}."),
    "book_table": ("Book a table for {v}.", "Reserve dinner for {v}."),
    "call_friend": ("Call {v}.", "Phone {v} now."),
    "buy_tickets": ("Buy {v} for the film.", "Get me {v} for tonight."),
}
NEAR_PHRASES = {
    "get_weather": ("How warm is {v} today?",),
    "set_timer": ("Wake me after {v}.",),
    "play_song": ("I want to hear {v}.",),
    "book_table": ("We need a table, {v}.",),
    "call_friend": ("Ring {v} please.",),
    "buy_tickets": ("Order {v} for the movie.",),
}


NUMERIC = ("book_table", "buy_tickets", "set_timer")


def _value(rng: random.Random, tool: str, derived: bool, novel: bool, compact: bool = False) -> tuple[str, object]:
    """(surface text, argument value) of the tool's one argument."""
    words = {
        "get_weather": NEW_CITIES if novel else CITIES,
        "play_song": NEW_SONGS if novel else SONGS,
        "call_friend": NEW_PEOPLE if novel else PEOPLE,
    }.get(tool)
    if words is not None:
        v = rng.choice(words[: (1 if novel else 2)] if compact else words)
        return v, v
    if tool == "set_timer":
        if derived:  # 60h + m with m < 10: the digits of 6h followed by m
            h, m = rng.randint(1, 5), rng.randint(2, 9)
            return f"{h} hour{'s' if h > 1 else ''} {m} minutes", 60 * h + m
        m = rng.randint(1, 59)
        return f"{m} minutes", m
    noun = "people" if tool == "book_table" else "tickets"
    if derived:  # the sum of two number words, with a carry about half the time
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        lead = "tickets for " if tool == "buy_tickets" else ""
        adults, kids = ("adult" if a == 1 else "adults"), ("kid" if b == 1 else "kids")
        return f"{lead}{NUMBER_WORDS[a]} {adults} and {NUMBER_WORDS[b]} {kids}", a + b
    n = rng.randint(2, 12)
    return f"{n} {noun}", n


def _draw(split: str, difficulty: float, compact: bool = False):
    names = sorted(TOOLS)
    phrases = NEAR_PHRASES if split == "ood_near" else TRAIN_PHRASES
    n_calls = 2 if split == "ood_far" else 1

    def draw(rng: random.Random):
        parts, targets = [], []
        for _ in range(n_calls):
            derived = rng.random() < difficulty
            pool = [t for t in (NUMERIC if derived else names) if t not in targets]
            tool = rng.choice(pool)
            targets.append(tool)
            text, value = _value(rng, tool, derived, split == "ood_mid", compact)
            t = rng.randrange(len(phrases[tool]))
            parts.append((tool, t, text, json.dumps(value)))
        others = [t for t in names if t not in targets]
        shown = targets + rng.sample(others, 1 if compact else rng.randint(1, 2))
        rng.shuffle(shown)
        return (tuple(shown), tuple(parts))

    return draw, phrases


def tool_doc(name: str) -> dict:
    desc, params = TOOLS[name]
    return {
        "name": name,
        "description": desc,
        "parameters": {
            "type": "object",
            "properties": {k: {"type": t} for k, t in params.items()},
            "required": list(params),
        },
    }


def generate(
    split: str, n: int, seed: int, difficulty: float = DEFAULT_DIFFICULTY, compact: bool = False
) -> list[dict]:
    """`n` tooluse records of `split`; deterministic in (split, n, seed, difficulty, compact)."""
    check_args(split, n, difficulty)
    rng = rng_for("tooluse", split, seed, difficulty)
    draw, phrases = _draw(split, difficulty, compact)
    keys = sample_unique(rng, n, draw, split, what="tooluse")
    out = []
    for i, (shown, parts) in enumerate(keys):
        listing = ", ".join(f"{t}({', '.join(TOOLS[t][1])})" for t in shown)
        request = " ".join(phrases[tool][t].format(v=text) for tool, t, text, _ in parts)
        calls = [
            {"Action": tool, "Action_Input": {next(iter(TOOLS[tool][1])): json.loads(v)}} for tool, _, _, v in parts
        ]
        prompt = f"Tools: {listing}\n{request} {INSTRUCTION}"
        solution = "\n".join(f"Action: {c['Action']}\nAction Input: {json.dumps(c['Action_Input'])}" for c in calls)
        out.append(
            make_record("tooluse", split, seed, i, prompt, solution, tools=[tool_doc(t) for t in shown], answer=calls)
        )
    return out
