"""A small RAG set: invented documents with facts, questions with known answers.

It is what approximations of KVLens are judged by (issue 38 item 3b): answer accuracy against
the known answers, and token agreement with full prefill. The facts are made up (a ferry line,
a library, a kettle, ...) so that a model cannot answer from what it already knows; each
question needs exactly one document, and its answer is written in that document.

The layout is ready for blending (reusing a document's KV wherever it sits in a prompt):
documents first, the question last, so the documents are a reusable prefix; every document
stands alone (its title inside it, no reference to another) and any order of them makes a
valid prompt; documents are joined by ``SEPARATOR``, which begins and ends at a line break so
that a document's tokens do not merge with its neighbours'.

Standard library only, and no other bench module: the demo (``scripts/workload.py``) imports it.
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

SYSTEM_PROMPT = (
    "You are a careful assistant. Answer the question using only the documents the user gives you. "
    "Reply with one short sentence that states the answer."
)
SEPARATOR = "\n\n"  # between documents, and between the last document and the question
QUESTION_PREFIX = "Question: "


@dataclass(frozen=True, slots=True)
class Document:
    key: str  # short stable name ("ferry")
    title: str
    text: str

    def render(self) -> str:
        """The document as it appears in a prompt: its title line, then its text."""
        return f"{self.title}\n{self.text}"


@dataclass(frozen=True, slots=True)
class Question:
    key: str  # stable name ("ferry-pier")
    document: str  # the key of the one document that answers it
    text: str
    answer: str  # the canonical short answer
    aliases: tuple[str, ...] = ()  # other accepted forms ("twelve" for "12")

    @property
    def accepted(self) -> tuple[str, ...]:
        return (self.answer, *self.aliases)


DOCUMENTS: tuple[Document, ...] = (
    Document(
        "ferry",
        "Harlow Bay Ferry Service",
        "The Harlow Bay ferry carries passengers between the town of Harlow and Sennick Island. "
        "Ferries leave from Pier 9 at the end of Quay Street. The first ferry of the day leaves at "
        "6:40 in the morning and the last one leaves at 9:15 in the evening. The crossing takes "
        "35 minutes in calm weather. An adult single ticket costs 7 dollars, and children under "
        "twelve travel free. The largest boat of the fleet is called the Marigold; it can carry "
        "220 passengers and 14 cars. Bicycles are carried on the lower deck for an extra 2 dollars. "
        "When the wind is stronger than 50 kilometres per hour, crossings are cancelled and a notice "
        "is posted at the ticket office.",
    ),
    Document(
        "library",
        "Quillfeather Library Borrowing Rules",
        "Members of the Quillfeather Library may borrow up to 12 books at a time. The loan period "
        "for books is 21 days, and a loan can be renewed twice. Films and music discs may be kept "
        "for 7 days only. The late fee is 30 cents per item for each day it is overdue. The library "
        "is open from Tuesday to Sunday and is closed on Mondays. The reading room on the second "
        "floor is reserved for quiet study. The head librarian is Odile Brannock, who has run the "
        "library since 2011. A library card is free for residents; visitors pay 15 dollars a year. "
        "Lost cards are replaced at the front desk for 3 dollars.",
    ),
    Document(
        "kettle",
        "Veltrix K2 Electric Kettle: Specifications",
        "The Veltrix K2 is an electric kettle with a capacity of 1.6 litres. Its heating element "
        "is rated at 2,200 watts, and it brings a full kettle to the boil in about 4 minutes. The "
        "body is made of brushed steel and comes in one colour, called Harbour Grey. The kettle "
        "weighs 1.1 kilograms when empty. It has a keep-warm mode that holds the water at 80 "
        "degrees for up to 30 minutes. The power cord is 75 centimetres long. The Veltrix K2 is "
        "sold with a warranty of 3 years, and its limescale filter should be replaced every "
        "6 months. It is made in a factory in the city of Ostrava.",
    ),
    Document(
        "festival",
        "Corrin Valley Orchard Festival",
        "The Corrin Valley Orchard Festival takes place every year in the third week of September "
        "in the village of Corrin. It was first held in 1987. The festival celebrates a local apple "
        "called the Red Tamsin, which grows only in the valley. The main event is a pie contest, and "
        "the winner receives a prize of 500 dollars and a copper ladle. The festival's mascot is a "
        "hedgehog named Pip. About 9,000 visitors come each year. Entry is free, but parking in the "
        "school field costs 5 dollars. The festival ends on Sunday evening with a lantern walk along "
        "the river Corr. The festival committee meets in the village hall every Saturday from June "
        "onward, and volunteers are always welcome.",
    ),
    Document(
        "travel",
        "Northwind Logistics Travel Policy",
        "Employees of Northwind Logistics book all business trips through the company portal called "
        "TripDesk. Every trip must be approved by the employee's department head before it is booked. "
        "The maximum hotel rate is 180 dollars per night. The daily meal allowance is 55 dollars. For "
        "journeys shorter than 400 kilometres, employees must travel by train rather than by plane. "
        "Flights of more than 6 hours may be booked in premium economy. Receipts must be uploaded "
        "within 10 days of the end of the trip. Taxi rides are refunded only after 10 in the evening "
        "or when no train or bus is available. Employees who travel more than twice a month receive "
        "a company card.",
    ),
    Document(
        "observatory",
        "Mount Aldery Observatory",
        "The Mount Aldery Observatory stands at an altitude of 3,120 metres. It was founded in 1964 "
        "by the astronomer Lena Varga. Its main telescope has a mirror 2.4 metres across and is named "
        "the Kestrel Telescope. The observatory is open to visitors on Friday nights, when a guide "
        "shows the sky through a smaller telescope. A visit costs 12 dollars. The road to the top has "
        "14 hairpin bends and is closed from December to March because of snow. Around 40 scientists "
        "work at the observatory. Its best known discovery is a comet called Varga-3, found in 1979. "
        "Visitors are asked to dress warmly, since the night air is cold even in summer.",
    ),
    Document(
        "vacuum",
        "Brisco R7 Robot Vacuum",
        "The Brisco R7 is a robot vacuum cleaner made by Brisco Robotics. Its battery lasts 90 "
        "minutes on a full charge, and charging takes 3 hours. The dust bin holds 0.5 litres. The "
        "robot has 4 cleaning modes: quiet, standard, turbo and edge. It is controlled with a phone "
        "app called HomeLoop. The R7 is 9 centimetres tall, so it fits under most sofas. It can climb "
        "over thresholds up to 2 centimetres high. The side brush should be replaced every 3 months. "
        "The R7 is sold in two colours, white and a dark red called Ember. A spare filter and two "
        "side brushes come in the box.",
    ),
    Document(
        "council",
        "Tesselwick Town Council",
        "Tesselwick is a small market town on the river Lume, with a population of about 8,400. "
        "The mayor of Tesselwick is Agnes Holloway, who was elected in 2019. The town council has "
        "11 members and meets on the first Tuesday of every month in the old wool hall. The weekly "
        "market is held on Thursdays in Bell Square. The town's oldest building is Saint Oda's "
        "chapel, built in 1342. Tesselwick is twinned with the town of Marvejac. The council runs "
        "a free bus that goes around the town every 20 minutes. Recycling is collected on Wednesdays. "
        "Council meetings are open to the public.",
    ),
)

QUESTIONS: tuple[Question, ...] = (
    Question("ferry-pier", "ferry", "From which pier do the Harlow Bay ferries leave?", "9", ("nine",)),
    Question(
        "ferry-minutes",
        "ferry",
        "How many minutes does the Harlow Bay ferry crossing take in calm weather?",
        "35",
        ("thirty-five",),
    ),
    Question(
        "ferry-boat", "ferry", "What is the name of the largest boat of the Harlow Bay fleet?", "Marigold"
    ),
    Question(
        "library-books",
        "library",
        "Up to how many books at a time may members of the Quillfeather Library borrow?",
        "12",
        ("twelve",),
    ),
    Question("library-head", "library", "Who is the head librarian of the Quillfeather Library?", "Brannock"),
    Question(
        "library-loan",
        "library",
        "What is the loan period for books at the Quillfeather Library?",
        "21 days",
        ("twenty-one days", "21"),
    ),
    Question(
        "kettle-capacity",
        "kettle",
        "What is the capacity of the Veltrix K2 electric kettle?",
        "1.6 litres",
        ("1.6 liters", "1.6 l", "1.6"),
    ),
    Question(
        "kettle-warranty",
        "kettle",
        "How many years of warranty does the Veltrix K2 kettle have?",
        "3",
        ("three",),
    ),
    Question("kettle-city", "kettle", "In which city is the Veltrix K2 kettle made?", "Ostrava"),
    Question(
        "festival-apple",
        "festival",
        "What is the local apple celebrated at the Corrin Valley Orchard Festival?",
        "Red Tamsin",
        ("Tamsin",),
    ),
    Question(
        "festival-mascot", "festival", "What is the name of the Corrin Valley festival's mascot?", "Pip"
    ),
    Question(
        "festival-year",
        "festival",
        "In which year was the Corrin Valley Orchard Festival first held?",
        "1987",
    ),
    Question(
        "travel-portal",
        "travel",
        "Through which company portal do Northwind Logistics employees book trips?",
        "TripDesk",
        ("Trip Desk",),
    ),
    Question(
        "travel-hotel",
        "travel",
        "What is the maximum hotel rate per night at Northwind Logistics?",
        "180",
        ("one hundred and eighty",),
    ),
    Question(
        "travel-meal",
        "travel",
        "What is the daily meal allowance at Northwind Logistics?",
        "55",
        ("fifty-five",),
    ),
    Question(
        "observatory-founder",
        "observatory",
        "Who founded the Mount Aldery Observatory?",
        "Lena Varga",
        ("Varga",),
    ),
    Question(
        "observatory-telescope",
        "observatory",
        "What is the name of the main telescope of the Mount Aldery Observatory?",
        "Kestrel",
    ),
    Question(
        "observatory-altitude",
        "observatory",
        "At what altitude does the Mount Aldery Observatory stand?",
        "3,120",
        ("3120", "3 120"),
    ),
    Question(
        "vacuum-app",
        "vacuum",
        "What is the name of the phone app that controls the Brisco R7?",
        "HomeLoop",
        ("Home Loop",),
    ),
    Question(
        "vacuum-battery",
        "vacuum",
        "How long does the battery of the Brisco R7 last on a full charge?",
        "90",
        ("ninety",),
    ),
    Question(
        "vacuum-modes", "vacuum", "How many cleaning modes does the Brisco R7 robot have?", "4", ("four",)
    ),
    Question("council-mayor", "council", "Who is the mayor of Tesselwick?", "Agnes Holloway", ("Holloway",)),
    Question("council-river", "council", "On which river is the town of Tesselwick?", "Lume"),
    Question(
        "council-twin",
        "council",
        "With which town is Tesselwick twinned?",
        "Marvejac",
    ),
)

_BY_KEY = {d.key: d for d in DOCUMENTS}


def document(key: str) -> Document:
    return _BY_KEY[key]


def canonical_order() -> tuple[str, ...]:
    return tuple(d.key for d in DOCUMENTS)


def permuted_order(seed: int) -> tuple[str, ...]:
    """A fixed shuffle of the documents (the same for every caller with the same seed)."""
    keys = list(canonical_order())
    random.Random(seed).shuffle(keys)
    return tuple(keys)


# Orders a benchmark names: the documents as listed, and shuffles a blender must handle.
ORDERS: dict[str, tuple[str, ...]] = {
    "canonical": canonical_order(),
    "reversed": tuple(reversed(canonical_order())),
    "shuffled": permuted_order(38),
}


def documents_text(order: Sequence[str] = canonical_order()) -> str:
    """The documents of ``order``, each followed by ``SEPARATOR``: the reusable part of a prompt."""
    return "".join(document(k).render() + SEPARATOR for k in order)


def user_message(question: Question, order: Sequence[str] = canonical_order()) -> str:
    if question.document not in order:
        raise ValueError(
            f"question {question.key} needs document {question.document!r}, not in {list(order)}"
        )
    return documents_text(order) + QUESTION_PREFIX + question.text


def messages(question: Question, order: Sequence[str] = canonical_order()) -> list[dict[str, str]]:
    """The chat messages of one request: the system prompt, then the documents in ``order``, then
    the question (documents before the question, so they are a prefix every question shares)."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_message(question, order)},
    ]


def normalise(text: str) -> str:
    """Lower case, accents and punctuation gone, thousands separators and hyphens joined up,
    whitespace collapsed."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = re.sub(r"(?<=\d)[,\u202f ](?=\d{3}\b)", "", text)  # 3,120 / 3 120 -> 3120
    text = re.sub(r"[^\w\s]", " ", text.replace("-", " "))
    return " ".join(text.split())


def first_sentence(text: str) -> str:
    """Up to the first full stop, question or exclamation mark followed by a space ("1.6" stays)."""
    return re.split(r"(?<=[.!?])\s+", text.strip(), maxsplit=1)[0]


def is_correct(answer: str, question: Question) -> bool:
    """Whether the first sentence of ``answer`` contains one of the accepted answers as whole
    words. The system prompt asks for one sentence: an answer that names another value first and
    the right one later ("2 cleaning modes. ... 4 cleaning modes") is wrong."""
    said = f" {normalise(first_sentence(answer))} "
    return any(f" {normalise(a)} " in said for a in question.accepted if normalise(a))


def questions_for(document_key: str) -> tuple[Question, ...]:
    return tuple(q for q in QUESTIONS if q.document == document_key)


def token_agreement(reference: Sequence[int], answer: Sequence[int]) -> float:
    """The share of tokens two greedy answers have in common up to their first difference, over
    the longer one (1.0: the same answer; 0.0: they differ from the first token)."""
    longest = max(len(reference), len(answer))
    if longest == 0:
        return 1.0
    same = 0
    for a, b in zip(reference, answer, strict=False):
        if a != b:
            break
        same += 1
    return same / longest
