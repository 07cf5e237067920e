"""The built-in corpus: English-like documents generated from our own templates and word lists.

A seed fixes a small made-up world (towns with rivers, regions, neighbours, people, trades and founding years);
documents then state its facts in varied templates, alongside arithmetic drills, counting, lists, short stories
and question/answer pairs. Facts repeat across documents with the same values, so a tiny model can visibly learn
them (and the arithmetic) within a few hundred steps. No third-party text is involved.
"""
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "th", "v", "w"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "nd", "rk"]
_TOWN_ENDINGS = ["ford", "ton", "by", "mere", "wick", "dale", "holm", "stead", "port", "field"]
_FIRST_NAMES = [
    "Ada", "Bram", "Cora", "Dov", "Elin", "Fenn", "Greta", "Hal", "Ines", "Jory", "Kira", "Lio", "Mara", "Nils",
    "Oona", "Pell", "Quin", "Rhea", "Sten", "Tova", "Ulla", "Vik", "Wren", "Yara", "Zeb",
]
_TRADES = ["salt", "wool", "rope", "glass", "cheese", "timber", "copper", "honey", "paper", "barley", "clay", "iron"]
_MARKET_GOODS = ["apples", "bread", "eggs", "fish", "lamps", "nails", "onions", "pears", "soap", "candles", "boots"]
_COLORS = ["red", "blue", "green", "yellow", "white", "black", "orange", "grey"]
_DIRECTIONS = {"north": "south", "south": "north", "east": "west", "west": "east"}
_ANIMALS = ["goats", "geese", "sheep", "horses", "cows", "ducks", "pigs", "hens"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve"]
_WEEKDAYS = ["Moonday", "Tidesday", "Windsday", "Thornsday", "Firesday", "Starday", "Sunday"]


@dataclass
class Town:
    name: str
    region: str
    river: str
    population: int
    founded: int
    trade: str
    colors: tuple[str, str]
    mayor: str
    neighbours: dict[str, str]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def _unique_names(rng: random.Random, count: int, make) -> list[str]:
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < count:
        name = make().capitalize()
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def build_world(seed: int, num_towns: int = 120) -> list[Town]:
    """The made-up world fixed by `seed`: towns on a grid, each linked to its grid neighbours."""
    rng = random.Random(seed)
    regions = _unique_names(rng, 6, lambda: _word(rng, 2))
    rivers = _unique_names(rng, 12, lambda: _word(rng, 1))
    families = _unique_names(rng, 40, lambda: _word(rng, 2))
    names = _unique_names(rng, num_towns, lambda: _word(rng, 1) + rng.choice(_TOWN_ENDINGS))
    width = max(1, int(num_towns**0.5))
    towns = []
    for i, name in enumerate(names):
        towns.append(
            Town(
                name=name,
                region=regions[(i // width) * len(regions) // (num_towns // width + 1)],
                river=rng.choice(rivers),
                population=rng.randrange(200, 20000),
                founded=rng.randrange(900, 1900),
                trade=rng.choice(_TRADES),
                colors=tuple(rng.sample(_COLORS, 2)),
                mayor=f"{rng.choice(_FIRST_NAMES)} {rng.choice(families)}",
                neighbours={},
            )
        )
    for i, town in enumerate(towns):
        row, col = divmod(i, width)
        for direction, (dr, dc) in {"north": (-1, 0), "south": (1, 0), "west": (0, -1), "east": (0, 1)}.items():
            r, c = row + dr, col + dc
            j = r * width + c
            if 0 <= r and 0 <= c < width and j < len(towns):
                town.neighbours[direction] = towns[j].name
    return towns


def _town_profile(rng: random.Random, towns: list[Town]) -> str:
    t = rng.choice(towns)
    sentences = [
        f"{t.name} is a town in the {t.region} region.",
        f"About {t.population} people live in {t.name}.",
        f"The river {t.river} runs through {t.name}.",
        f"{t.name} was founded in the year {t.founded}.",
        f"The people of {t.name} are known for their {t.trade}.",
        f"The flag of {t.name} is {t.colors[0]} and {t.colors[1]}.",
        f"The mayor of {t.name} is {t.mayor}.",
    ]
    sentences += [f"To the {d} of {t.name} lies {n}." for d, n in t.neighbours.items()]
    body = sentences[:1] + rng.sample(sentences[1:], k=rng.randrange(3, len(sentences)))
    return f"{t.name}\n\n" + " ".join(body)


def _journey(rng: random.Random, towns: list[Town]) -> str:
    by_name = {t.name: t for t in towns}
    here = rng.choice(towns)
    walker = rng.choice(_FIRST_NAMES)
    lines = [f"{walker} set out from {here.name}."]
    for _ in range(rng.randrange(2, 6)):
        if not here.neighbours:
            break
        direction = rng.choice(sorted(here.neighbours))
        there = by_name[here.neighbours[direction]]
        lines.append(
            f"{walker} walked {direction} from {here.name} and came to {there.name}, on the river {there.river}."
        )
        here = there
    lines.append(f"At the end of the day {walker} rested in {here.name}.")
    return " ".join(lines)


def _arithmetic(rng: random.Random) -> str:
    lines = ["Sums for practice."]
    for _ in range(rng.randrange(4, 10)):
        a, b = rng.randrange(0, 50), rng.randrange(0, 50)
        op = rng.choice(["plus", "minus", "times"])
        if op == "plus":
            lines.append(f"{a} plus {b} is {a + b}.")
        elif op == "minus":
            a, b = max(a, b), min(a, b)
            lines.append(f"{a} minus {b} is {a - b}.")
        else:
            a, b = a % 13, b % 13
            lines.append(f"{a} times {b} is {a * b}.")
    return "\n".join(lines)


def _counting(rng: random.Random) -> str:
    start, step = rng.randrange(0, 90), rng.choice([1, 1, 2, 5, 10])
    numbers = [str(start + step * i) for i in range(rng.randrange(5, 12))]
    words = ", ".join(_NUMBER_WORDS[: rng.randrange(4, len(_NUMBER_WORDS))])
    day = rng.randrange(len(_WEEKDAYS))
    week = ", ".join(_WEEKDAYS[day:] + _WEEKDAYS[:day])
    return (
        f"Counting from {start} in steps of {step}: {', '.join(numbers)}.\n"
        f"The number words are {words}.\nThe days of the week, starting on {_WEEKDAYS[day]}, are {week}."
    )


def _market(rng: random.Random, towns: list[Town]) -> str:
    t = rng.choice(towns)
    goods = rng.sample(_MARKET_GOODS, rng.randrange(3, 6))
    buyer = rng.choice(_FIRST_NAMES)
    count_a, count_b = rng.randrange(1, 7), rng.randrange(1, 7)
    return (
        f"On {rng.choice(_WEEKDAYS)} there is a market in {t.name}. "
        f"You can buy {', '.join(goods[:-1])} and {goods[-1]}. "
        f"{buyer} bought {_NUMBER_WORDS[count_a]} {goods[0]} and {_NUMBER_WORDS[count_b]} {goods[1]}. "
        f"That is {count_a + count_b} things in all. "
        f"Near the market, {rng.randrange(2, 30)} {rng.choice(_ANIMALS)} stood in a pen, and traders sold {t.trade}."
    )


def _questions(rng: random.Random, towns: list[Town]) -> str:
    pairs = []
    for t in rng.sample(towns, rng.randrange(2, 5)):
        pairs += rng.sample(
            [
                (f"Which river runs through {t.name}?", f"The river {t.river}."),
                (f"How many people live in {t.name}?", f"About {t.population}."),
                (f"When was {t.name} founded?", f"In {t.founded}."),
                (f"What is {t.name} known for?", f"Its {t.trade}."),
                (f"Who is the mayor of {t.name}?", f"{t.mayor}."),
                (f"In which region is {t.name}?", f"In the {t.region} region."),
            ],
            2,
        )
    return "\n".join(f"Question: {q}\nAnswer: {a}" for q, a in pairs)


def iter_documents(seed: int = 0, num_docs: int = 12000) -> Iterator[dict]:
    """Yield `num_docs` documents {"id": int, "text": str}; the same seed always gives the same documents."""
    towns = build_world(seed)
    rng = random.Random(seed + 1)
    kinds = [
        lambda: _town_profile(rng, towns),
        lambda: _journey(rng, towns),
        lambda: _arithmetic(rng),
        lambda: _counting(rng),
        lambda: _market(rng, towns),
        lambda: _questions(rng, towns),
    ]
    for i in range(num_docs):
        parts = [rng.choice(kinds)() for _ in range(rng.randrange(1, 4))]
        yield {"id": i, "text": "\n\n".join(parts)}


def write_corpus(path: str, seed: int = 0, num_docs: int = 12000) -> str:
    """Write the corpus as jsonl (one {"id", "text"} object per line) atomically; returns `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in iter_documents(seed, num_docs):
            f.write(json.dumps(doc) + "\n")
    os.replace(tmp, path)
    return path
