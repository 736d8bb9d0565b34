"""Prompts of chosen lengths in a model's own tokens, for benchmarks that must pay for prefill.

A :class:`Mix` names the prompt lengths of realtime questions and of batch documents as ranges of
tokens. :class:`Prompts` writes, for question ``number`` of a kind, a text whose length is drawn
uniformly from its range and measured with the model directory's own tokenizer
(``transformers.AutoTokenizer``, counted as vLLM counts a completions prompt): the draw and the
words are seeded by (seed, kind, number), so the same question gets the same prompt in every setup
of a run, and a run can be repeated. The words come from a seeded source of a few hundred varied
words, so no two prompts share more than their opening: a prefix cache hits only what a real
service would share, the system preamble that the chat mixes put before every question.

    prompts = Prompts(MIXES["chat"], model_dir, seed=8)
    prompt = prompts.realtime(17)          # Prompt(text, tokens)
    lengths([prompts.batch(n).tokens for n in range(200)])   # {"p50", "p90", "max", "n"}

The ``short`` mix is the fixed few-dozen-token texts the overload benchmark was first run with
(:func:`question_prompt`, :func:`batch_prompt`), measured the same way.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from pathlib import Path

TOPICS = ("why queues collapse under load", "what a token bucket is", "how continuous batching works",
          "when to shed load", "what a KV cache holds", "how retries amplify overload",
          "what Little's law says", "why deadlines beat timeouts", "how priority scheduling works",
          "what a prefix cache saves", "why p99 matters", "how to size a batch")

# What a chat service puts before every user's question; cut to PREAMBLE_TOKENS of the model's tokens.
PREAMBLE = ("You are the support assistant of a small company that runs a hosted job queue for language "
            "model inference. Answer briefly and plainly, cite the relevant setting by its name when one "
            "applies, never invent figures, and say so when a question falls outside what you know about. "
            "Keep each answer under two short paragraphs.")
PREAMBLE_TOKENS = 50

WORDS = """
able about above across act add after again against age ago agree air all allow almost alone along already
also always among amount and animal answer any appear apply area argue arm around arrive art ask attack
avoid away baby back bad bag ball bank base bear beat beautiful because become bed before begin behind
believe best better between beyond big bill bird black blood blue board boat body book born both box boy
break bring brother budget build burn business buy call camera campaign cancel car card care carry case
catch cause cell center century certain chair chance change charge check child choice choose church city
claim class clear close coach cold collect color come common company compare computer condition consider
contain continue control cost could country couple course court cover create crime cultural cup current
customer cut dark data daughter day dead deal death debate decade decide deep defense degree describe
design detail develop die difference difficult dinner direction discover discuss disease doctor dog door
down draw dream drive drop drug during early east easy eat economy edge effect effort eight either
election else employee end energy enjoy enough enter entire environment evening event every evidence exactly
example expect experience expert explain eye face fact factor fail fall family far fast father fear federal
feel few field fight figure fill film final finally find fine finger finish fire firm first fish five floor
fly focus follow food foot force foreign forget form forward four free friend front full fund future game
garden gas general generation girl give glass goal good government great green ground group grow growth
guess gun guy hair half hand hang happen happy hard have head health hear heart heat heavy help here high
history hold home hope hospital hot hotel hour house huge human hundred husband idea identify image imagine
impact important improve include increase indeed indicate industry inside instead interest interview into
investment issue item itself job join just keep key kid kill kind kitchen know knowledge land language large
last late later laugh law lawyer lay lead learn least leave left leg legal less letter level lie life light
like likely line list listen little live local long look lose loss lot love low machine magazine main
maintain major make manage manager many market marriage material matter maybe measure media medical meet
meeting member memory mention message method middle might military million mind minute miss mission model
modern moment money month more morning most mother mouth move movie much music must myself name nation
natural nature near nearly necessary need network never news newspaper next nice night none north note
nothing notice number occur offer office officer official often oil old once only open operation opportunity
option order organization other outside over own owner page pain painting paper parent part partner party
pass past patient pattern pay peace people perform perhaps period person phone physical pick picture piece
place plan plant play player point police policy political poor popular position positive possible power
practice prepare present president pressure pretty prevent price private probably problem process produce
product program project property protect prove provide public pull purpose push quality question quickly
quite race radio raise range rate rather reach read ready real reason receive recent record red reduce
reflect region relate remain remember remove report represent require research resource respond rest result
return reveal rich right rise risk river road rock role room rule run safe same save scene school science
score sea season seat second section security seek seem sell send senior sense series serious serve service
set seven several shake share shoot short shoulder show side sign similar simple simply since sing single
sister sit site situation six size skill skin small smile social society soldier some song soon sort sound
source south space speak special specific speech spend sport spring staff stage stand standard star start
state station stay step still stock stop store story strategy street strong structure student study stuff
style subject success suddenly suffer suggest summer supply support sure surface system table take talk task
teach team technology television tell ten tend term test than thank that their theory there these thing
think third those though thought thousand threat three through throughout throw thus time today together
tonight total tough toward town trade traditional training travel treat treatment tree trial trip trouble
true truth try turn type under understand unit until upon usually value various very victim view violence
visit voice vote wait walk wall want watch water way weapon wear week weight well west western whatever
wheel where whether which while white whole whose wide wife will wind window wish within without woman
wonder word work worker world worry would write writer wrong yard yeah year yes yet young yourself
""".split()


def question_prompt(number: int) -> str:
    """The short mix's realtime question; the number makes each user's question its own."""
    return f"Question {number}: in two sentences, {TOPICS[number % len(TOPICS)]}?"


def batch_prompt(number: int) -> str:
    """The short mix's document to summarise, distinct per job so no prefix cache flatters the batch."""
    body = " ".join(f"Line {i} of report {number}: throughput, latency and queue depth by hour."
                    for i in range(12))
    return f"Summarise report {number}.\n{body}"


@dataclass(frozen=True)
class Span:
    """Prompt lengths drawn uniformly from ``low``..``high`` tokens, for ``share`` of a kind's prompts."""

    low: int
    high: int
    share: float = 1.0


@dataclass(frozen=True)
class Mix:
    """The prompt lengths of one kind of traffic. No spans: the short mix's fixed texts."""

    name: str
    summary: str
    realtime: tuple[Span, ...] = ()
    batch: tuple[Span, ...] = ()
    preamble: bool = False  # realtime prompts open with the shared system preamble (counted in their length)


MIXES = {mix.name: mix for mix in (
    Mix("short", "questions of a few dozen tokens, reports of a few hundred (the first runs' texts)"),
    Mix("chat", "realtime 100-400 tokens after a shared 50-token preamble; batch documents 200-600",
        realtime=(Span(100, 400),), batch=(Span(200, 600),), preamble=True),
    Mix("summarise", "batch documents 800-3,000 tokens; realtime 100-200 after the preamble",
        realtime=(Span(100, 200),), batch=(Span(800, 3000),), preamble=True),
    Mix("long", "as chat, but 15% of realtime prompts 3,000-4,000 tokens",
        realtime=(Span(100, 400, 0.85), Span(3000, 4000, 0.15)), batch=(Span(200, 600),), preamble=True),
)}


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # measured with the model's tokenizer, as the engine will count it


def context_tokens(model_dir: Path) -> int | None:
    """The model's context (``max_position_embeddings`` of its config.json), None if it names none."""
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def clamp(mix: Mix, limit: int) -> tuple[Mix, list[str]]:
    """``mix`` with no prompt longer than ``limit`` tokens, and a sentence for each range it cut."""
    notes = []

    def cut(kind: str, spans: tuple[Span, ...]) -> tuple[Span, ...]:
        out = []
        for span in spans:
            low, high = min(span.low, limit), min(span.high, limit)
            if high != span.high:
                notes.append(f"{mix.name} mix: {kind} prompts of {span.low}-{span.high} tokens cut to {low}-{high} "
                             f"(the context leaves {limit} tokens for a prompt)")
            out.append(Span(low, high, span.share))
        return tuple(out)

    return Mix(mix.name, mix.summary, cut("realtime", mix.realtime), cut("batch", mix.batch), mix.preamble), notes


def longest(mix: Mix) -> int | None:
    """The longest prompt ``mix`` asks for, in tokens (None: the short mix's texts, a few dozen)."""
    return max((span.high for span in mix.realtime + mix.batch), default=None)


class Prompts:
    """The prompts of one mix in one model's tokens. Safe to share between threads."""

    def __init__(self, mix: Mix, model_dir: Path, seed: int) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # library chatter on a tokenizer-only directory
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.mix, self.seed = mix, seed
        self._lock = threading.Lock()  # a fast tokenizer must not be entered from two threads at once
        self.preamble = self._cut(PREAMBLE, PREAMBLE_TOKENS).text + "\n\n" if mix.preamble else ""

    def count(self, text: str) -> int:
        with self._lock:
            return len(self.tokenizer(text)["input_ids"])

    def realtime(self, number: int) -> Prompt:
        if not self.mix.realtime:
            text = question_prompt(number)
            return Prompt(text, self.count(text))
        rng = random.Random(f"{self.seed}/realtime/{number}")
        return self._cut(f"{self.preamble}Question {number}: {_sentences(rng, 40)}", _draw(rng, self.mix.realtime),
                         rng)

    def batch(self, number: int) -> Prompt:
        if not self.mix.batch:
            text = batch_prompt(number)
            return Prompt(text, self.count(text))
        rng = random.Random(f"{self.seed}/batch/{number}")
        return self._cut(f"Summarise report {number}.\n{_sentences(rng, 40)}", _draw(rng, self.mix.batch), rng)

    def _cut(self, text: str, tokens: int, rng: random.Random | None = None) -> Prompt:
        """``text``, grown with more of ``rng``'s sentences until it holds ``tokens`` tokens, cut
        there. Decoding a cut and encoding it again may merge across the cut: the length returned
        is the one measured on the text returned."""
        with self._lock:
            ids = self.tokenizer(text)["input_ids"]
            while len(ids) < tokens and rng is not None:
                text += " " + _sentences(rng, tokens - len(ids))  # about a word a token: a few rounds
                ids = self.tokenizer(text)["input_ids"]
            text = self.tokenizer.decode(ids[:tokens], skip_special_tokens=True, clean_up_tokenization_spaces=False)
            return Prompt(text, len(self.tokenizer(text)["input_ids"]))


def _draw(rng: random.Random, spans: tuple[Span, ...]) -> int:
    at, pick = rng.random() * sum(s.share for s in spans), spans[-1]
    for span in spans:
        if at < span.share:
            pick = span
            break
        at -= span.share
    return rng.randint(pick.low, pick.high)


def _sentences(rng: random.Random, words: int) -> str:
    """At least ``words`` words of sentences drawn from WORDS, with a number now and then."""
    out: list[str] = []
    while len(out) < words:
        sentence = [str(rng.randint(2, 9999)) if rng.random() < 0.06 else rng.choice(WORDS)
                    for _ in range(rng.randint(6, 18))]
        sentence[0] = sentence[0].capitalize()
        out.extend(sentence[:-1] + [sentence[-1] + rng.choice("....?!")])
    return " ".join(out)


def lengths(tokens: list[int]) -> dict:
    """p50, p90 and max (nearest rank) and how many, of prompt lengths in tokens."""
    ordered = sorted(tokens)
    if not ordered:
        return {"p50": None, "p90": None, "max": None, "n": 0}
    p50, p90 = (ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.9))
    return {"p50": p50, "p90": p90, "max": ordered[-1], "n": len(ordered)}


def describe(summary: dict) -> str:
    """``lengths``'s summary as a table cell: "p50 230 / p90 370 / max 400 tokens"."""
    if not summary["n"]:
        return "none sent"
    return f"p50 {summary['p50']} / p90 {summary['p90']} / max {summary['max']} tokens"
