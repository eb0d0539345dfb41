"""Regenerate the trie pictures used in the docs (needs graphviz's `dot` binary).

    python docs/make_trie_images.py

writes docs/images/trie_example.svg (the trie of ``[b'cat', b'cats', b'dog', b'dogs']``)
and docs/images/trie_example_mass.svg (the same, nodes weighted and shaded by
``weight_sum`` of the masses ``[0.4, 0.1, 0.3, 0.2]``).
"""

from pathlib import Path

from genlm.backend import Token, TokenCharacterTrie

IMAGES = Path(__file__).parent / "images"
VOCAB = [b"cat", b"cats", b"dog", b"dogs"]
MASSES = [0.4, 0.1, 0.3, 0.2]


def main() -> None:
    trie = TokenCharacterTrie([Token(i, b) for i, b in enumerate(VOCAB)])
    IMAGES.mkdir(parents=True, exist_ok=True)
    pictures = {
        "trie_example.svg": trie.visualize(),
        "trie_example_mass.svg": trie.visualize(trie.weight_sum(MASSES)),
    }
    for name, graph in pictures.items():
        (IMAGES / name).write_bytes(graph.pipe(format="svg"))
        print(f"wrote {IMAGES / name}")


if __name__ == "__main__":
    main()
