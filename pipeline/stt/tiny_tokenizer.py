"""The tiny profile's tokenizer: a small SentencePiece BPE model trained here, offline, from a
fixed text (no hub is reachable), once per cache directory and vocabulary size. The multilingual
one (for the language-prompted recogniser) learns from English, French, German and Spanish text
and carries language tags as pieces of their own, as the multilingual nemotron's vocabulary does."""
from __future__ import annotations

import os
import tempfile

_TOKENIZER_TEXT = """\
the quick brown fox jumps over the lazy dog while the band plays on
she sells sea shells by the sea shore and the shells she sells are surely sea shells
how much wood would a woodchuck chuck if a woodchuck could chuck wood
a voice assistant listens to the user and answers in real time without long pauses
please tell me the weather for tomorrow morning in the city where i live
can you book a table for two people at seven in the evening
i would like to hear some music from the seventies and eighties
what time is it now and how long will it take to get to the station
the meeting has been moved to thursday afternoon after lunch
remind me to call my mother when i get home tonight
there are many reasons why streaming speech recognition is hard
every word spoken should appear on the screen as soon as possible
she opened the window and looked at the bright blue sky above the hills
we walked along the river until the sun went down behind the trees
thank you very much for your help with this problem today
good morning everyone and welcome to the first lesson of the course
numbers like one two three four five six seven eight nine ten are common
the children were playing in the garden while their parents talked
could you repeat that please i did not hear the last part
turn off the lights in the kitchen and lock the front door
"""


_MULTILINGUAL_TEXT = """\
le chat noir dort sur le canapé pendant que la pluie tombe dehors
pouvez-vous réserver une table pour deux personnes à sept heures ce soir
quel temps fera-t-il demain matin dans la ville où j'habite
merci beaucoup pour votre aide avec ce problème aujourd'hui
éteignez les lumières de la cuisine et fermez la porte d'entrée
der schnelle braune fuchs springt über den faulen hund
können sie mir bitte sagen wie spät es jetzt ist
ich möchte heute abend musik aus den siebziger jahren hören
el perro come en la cocina mientras los niños juegan en el jardín
puedes repetir eso por favor no escuché la última parte
"""
# The tags of the tiny prompt dictionary's locales (pipeline/stt/model.py), one piece each.
LANGUAGE_TAGS = ["<en-US>", "<fr-FR>", "<de-DE>", "<es-ES>"]


def tiny_tokenizer_dir(cache_dir: str | None = None, vocab_size: int = 128, multilingual: bool = False) -> str:
    """Train (once, deterministically) a small SentencePiece BPE model; return its directory."""
    from nemo.collections.common.tokenizers.sentencepiece_tokenizer import create_spt_model

    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "gapless", "stt-tiny")
    out = os.path.join(cache_dir, f"spe_bpe_v{vocab_size}" + ("_multilingual" if multilingual else ""))
    if os.path.exists(os.path.join(out, "tokenizer.model")):
        return out
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir)
    text = os.path.join(tmp, "text.txt")
    with open(text, "w") as f:
        f.write((_TOKENIZER_TEXT + (_MULTILINGUAL_TEXT if multilingual else "")) * 4)
    create_spt_model(text, vocab_size, sample_size=-1, do_lower_case=True, tokenizer_type="bpe", output_dir=tmp,
                     user_defined_symbols=LANGUAGE_TAGS if multilingual else None)
    try:
        os.replace(tmp, out)  # atomic: a concurrent builder either wins or finds it done
    except OSError:
        pass
    return out
