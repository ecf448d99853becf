"""A generated multilingual parallel corpus: the integers 0..9999 written out in words.

Why: the demo and the tests need real translation data that is small, deterministic, free of
licences and learnable within minutes on a CPU, with held-out examples a model cannot have
memorised. Numbers in words have all of that: every language spells them with its own rules
(French ``quatre-vingt-dix-sept``, German ``siebenundneunzig``, Spanish ``noventa y siete``),
and the valid/test numbers never occur in training.

Each example is a number in one of a few phrase templates ("the number forty-two" /
"le nombre quarante-deux"). The templates use the plain counting form of the number, which needs
no agreement with a noun, so every sentence is grammatical. Spelling conventions: English
without "and" ("one hundred five"), French traditional spelling (hyphens below one hundred only,
"vingt et un", "quatre-vingts", "deux cents"), German in one word with "einhundert"/"eintausend",
Spanish standard ("veintiuno", "ciento uno", "quinientos"). Latin (``lat_Latn``, a language
NLLB-200 does not have: scripts/demo_add_language.sh adds it to a model) in the classical forms
("duodeviginti" 18, "undeviginti" 19, likewise 28-29 ... 88-89; "nonaginta octo" 98, "ducenti",
"mille", "duo milia", "tria milia"), "nihil" for zero.

``python -m fairseq_fsdp2.data.numbers RAW_DIR`` writes the raw layout that
``fairseq_fsdp2.data.prepare`` reads.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Callable, Iterable, Sequence

MAX_NUMBER = 9999

# --- English -------------------------------------------------------------------------------
_EN_SMALL = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
             "fourteen fifteen sixteen seventeen eighteen nineteen").split()
_EN_TENS = "- - twenty thirty forty fifty sixty seventy eighty ninety".split()


def english(n: int) -> str:
    if n < 20:
        return _EN_SMALL[n]
    if n < 100:
        tens, unit = divmod(n, 10)
        return _EN_TENS[tens] + (f"-{_EN_SMALL[unit]}" if unit else "")
    for size, name in ((1000, "thousand"), (100, "hundred")):
        if n >= size:
            head, rest = divmod(n, size)
            return f"{english(head)} {name}" + (f" {english(rest)}" if rest else "")
    raise AssertionError(n)


# --- French (traditional spelling) ---------------------------------------------------------
_FR_SMALL = ("zéro un deux trois quatre cinq six sept huit neuf dix onze douze treize quatorze "
             "quinze seize dix-sept dix-huit dix-neuf").split()
_FR_TENS = "- - vingt trente quarante cinquante soixante".split()


def _french_below_100(n: int) -> str:
    if n < 20:
        return _FR_SMALL[n]
    tens, unit = divmod(n, 10)
    if tens == 7:  # 60 + 10..19
        return "soixante et onze" if n == 71 else "soixante-" + _FR_SMALL[n - 60]
    if tens >= 8:  # 4 x 20 (+ 1..19); "quatre-vingts" takes the s only when it ends the number
        return "quatre-vingts" if n == 80 else "quatre-vingt-" + _FR_SMALL[n - 80]
    if unit == 0:
        return _FR_TENS[tens]
    return _FR_TENS[tens] + (" et un" if unit == 1 else "-" + _FR_SMALL[unit])


def _french_below_1000(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    if not hundreds:
        return _french_below_100(rest)
    head = "cent" if hundreds == 1 else _FR_SMALL[hundreds] + " cent"
    if not rest:
        return head + ("s" if hundreds > 1 else "")  # "deux cents", but "deux cent un"
    return f"{head} {_french_below_100(rest)}"


def french(n: int) -> str:
    thousands, rest = divmod(n, 1000)
    if not thousands:
        return _french_below_1000(rest)
    head = "mille" if thousands == 1 else _FR_SMALL[thousands] + " mille"  # mille: invariable
    return head + (f" {_french_below_1000(rest)}" if rest else "")


# --- German --------------------------------------------------------------------------------
_DE_SMALL = ("null eins zwei drei vier fünf sechs sieben acht neun zehn elf zwölf dreizehn "
             "vierzehn fünfzehn sechzehn siebzehn achtzehn neunzehn").split()
_DE_TENS = "- - zwanzig dreißig vierzig fünfzig sechzig siebzig achtzig neunzig".split()


def _german_prefix(n: int) -> str:
    """A digit inside a compound: "ein" rather than "eins" (einundzwanzig, einhundert)."""
    return "ein" if n == 1 else _DE_SMALL[n]


def _german_below_100(n: int) -> str:
    if n < 20:
        return _DE_SMALL[n]
    tens, unit = divmod(n, 10)
    return (f"{_german_prefix(unit)}und" if unit else "") + _DE_TENS[tens]


def german(n: int) -> str:
    if n == 0:
        return "null"
    thousands, rest = divmod(n, 1000)
    hundreds, rest = divmod(rest, 100)
    words = f"{_german_prefix(thousands)}tausend" if thousands else ""
    words += f"{_german_prefix(hundreds)}hundert" if hundreds else ""
    return words + (_german_below_100(rest) if rest else "")  # one word: hunderteins


# --- Spanish -------------------------------------------------------------------------------
_ES_SMALL = ("cero uno dos tres cuatro cinco seis siete ocho nueve diez once doce trece catorce "
             "quince dieciséis diecisiete dieciocho diecinueve veinte veintiuno veintidós "
             "veintitrés veinticuatro veinticinco veintiséis veintisiete veintiocho "
             "veintinueve").split()
_ES_TENS = "- - - treinta cuarenta cincuenta sesenta setenta ochenta noventa".split()
_ES_HUNDREDS = ("- ciento doscientos trescientos cuatrocientos quinientos seiscientos "
                "setecientos ochocientos novecientos").split()


def _spanish_below_1000(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    if n == 100:
        return "cien"
    if rest < 30:
        tail = _ES_SMALL[rest]
    else:
        tens, unit = divmod(rest, 10)
        tail = _ES_TENS[tens] + (f" y {_ES_SMALL[unit]}" if unit else "")
    if not hundreds:
        return tail
    return _ES_HUNDREDS[hundreds] + (f" {tail}" if rest else "")


def spanish(n: int) -> str:
    thousands, rest = divmod(n, 1000)
    if not thousands:
        return _spanish_below_1000(rest)
    head = "mil" if thousands == 1 else f"{_ES_SMALL[thousands]} mil"
    return head + (f" {_spanish_below_1000(rest)}" if rest else "")


# --- Latin ---------------------------------------------------------------------------------
_LA_SMALL = ("nihil unus duo tres quattuor quinque sex septem octo novem decem undecim duodecim "
             "tredecim quattuordecim quindecim sedecim septendecim").split()
_LA_TENS = ("- decem viginti triginta quadraginta quinquaginta sexaginta septuaginta octoginta "
            "nonaginta").split()
_LA_HUNDREDS = ("- centum ducenti trecenti quadringenti quingenti sescenti septingenti "
                "octingenti nongenti").split()


def _latin_below_100(n: int) -> str:
    if n < 18:
        return _LA_SMALL[n]
    tens, unit = divmod(n, 10)
    if unit in (8, 9) and tens < 9:  # two/one from the next ten: duodeviginti, undetriginta
        return ("duode" if unit == 8 else "unde") + _LA_TENS[tens + 1]
    return _LA_TENS[tens] + (f" {_LA_SMALL[unit]}" if unit else "")


def latin(n: int) -> str:
    if n == 0:
        return "nihil"
    thousands, rest = divmod(n, 1000)
    hundreds, rest = divmod(rest, 100)
    words = []
    if thousands:  # neuter with milia: duo, tria
        words.append("mille" if thousands == 1 else
                     {2: "duo", 3: "tria"}.get(thousands, _LA_SMALL[thousands]) + " milia")
    if hundreds:
        words.append(_LA_HUNDREDS[hundreds])
    if rest:
        words.append(_latin_below_100(rest))
    return " ".join(words)


NUMBER_WORDS: dict[str, Callable[[int], str]] = {
    "eng_Latn": english, "fra_Latn": french, "deu_Latn": german, "spa_Latn": spanish,
    "lat_Latn": latin,
}

# Phrase templates, aligned across languages by position; "{}" is the number in words.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "eng_Latn": ("{}", "the number {}", "page {}"),
    "fra_Latn": ("{}", "le nombre {}", "page {}"),
    "deu_Latn": ("{}", "die Zahl {}", "Seite {}"),
    "spa_Latn": ("{}", "el número {}", "página {}"),
    "lat_Latn": ("{}", "numerus {}", "pagina {}"),
}

DEFAULT_PAIRS = (("eng_Latn", "fra_Latn"), ("eng_Latn", "deu_Latn"), ("eng_Latn", "spa_Latn"))


def sentence(lang: str, n: int, template: int) -> str:
    if not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"numbers corpus covers 0..{MAX_NUMBER}, not {n}")
    return TEMPLATES[lang][template].format(NUMBER_WORDS[lang](n))


def split_numbers(n_valid: int, n_test: int, seed: int) -> tuple[list[int], list[int], list[int]]:
    """(train pool, valid, test): disjoint sets of numbers, the same for every language pair so
    that no held-out number reaches training through another pair."""
    numbers = list(range(MAX_NUMBER + 1))
    random.Random(seed).shuffle(numbers)
    if n_valid + n_test >= len(numbers):
        raise ValueError("n_valid + n_test leaves no numbers for training")
    return (numbers[n_valid + n_test:], numbers[:n_valid], numbers[n_valid:n_valid + n_test])


def write_corpus(raw_dir, pairs: Iterable[Sequence[str]] = DEFAULT_PAIRS, n_train: int = 5000,
                 n_valid: int = 200, n_test: int = 200, seed: int = 1) -> list[Path]:
    """Write ``{split}.{src}-{tgt}.{lang}`` files under raw_dir; return the paths written.

    Training examples are distinct (number, template) combinations from the training pool;
    valid and test use the held-out numbers, each once, with a template drawn at random.
    Deterministic for a given seed.
    """
    raw_dir = Path(raw_dir)
    raw_dir.mkdir(parents=True, exist_ok=True)
    pool, valid, test = split_numbers(n_valid, n_test, seed)
    written = []
    for src, tgt in pairs:
        for lang in (src, tgt):
            if lang not in NUMBER_WORDS:
                raise ValueError(f"no number words for {lang}; have {sorted(NUMBER_WORDS)}")
        n_templates = len(TEMPLATES[src])
        rng = random.Random(f"{seed}:{src}-{tgt}")  # str seeds are stable across runs
        if n_train > len(pool) * n_templates:
            raise ValueError(f"n_train={n_train} exceeds {len(pool) * n_templates} "
                             "distinct training examples")
        train = [divmod(i, n_templates) for i in rng.sample(range(len(pool) * n_templates),
                                                            n_train)]
        splits = {
            "train": [(pool[i], t) for i, t in train],
            "valid": [(n, rng.randrange(n_templates)) for n in valid],
            "test": [(n, rng.randrange(n_templates)) for n in test],
        }
        for split, examples in splits.items():
            if not examples:
                continue
            for lang in (src, tgt):
                path = raw_dir / f"{split}.{src}-{tgt}.{lang}"
                path.write_text("".join(sentence(lang, n, t) + "\n" for n, t in examples),
                                encoding="utf-8")
                written.append(path)
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_fsdp2.data.numbers", description=__doc__.split("\n\n")[0])
    parser.add_argument("raw_dir")
    parser.add_argument("--lang-pairs", default=",".join(f"{s}-{t}" for s, t in DEFAULT_PAIRS),
                        help="comma-separated SRC-TGT pairs from: " + ", ".join(NUMBER_WORDS))
    parser.add_argument("--n-train", type=int, default=5000)
    parser.add_argument("--n-valid", type=int, default=200)
    parser.add_argument("--n-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    pairs = [tuple(p.split("-")) for p in args.lang_pairs.split(",")]
    for path in write_corpus(args.raw_dir, pairs, args.n_train, args.n_valid, args.n_test,
                             args.seed):
        print(path)


if __name__ == "__main__":
    main()
