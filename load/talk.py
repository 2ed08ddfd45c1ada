"""Talk to a running gapless server from the command line.

    python -m load.talk --wav question.wav --out reply.wav
    python -m load.talk --text "What's the weather like?" --out reply.wav

Prints the transcript and the reply text, writes the reply audio (int16, 24 kHz).
"""
from __future__ import annotations

import argparse
import asyncio
import sys

from load.client import Conversation, add_token_argument
from pipeline.audio import float_to_int16, int16_to_float, read_wav, resample, write_wav
from pipeline.audio_constants import REPLY_RATE, USER_RATE


async def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/conversation")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--wav", help="a 16-bit WAV file to say (any rate; resampled to 16 kHz)")
    src.add_argument("--text", help="a typed turn (skips speech recognition)")
    ap.add_argument("--out", help="where to write the reply audio (WAV, 24 kHz)")
    ap.add_argument("--realtime", action="store_true", help="send audio at real-time pace")
    add_token_argument(ap)
    args = ap.parse_args(argv)

    async with Conversation(args.url, token=args.token) as conv:
        print(f"session {conv.ready['session_id']}", file=sys.stderr)
        if args.text is not None:
            result = await conv.say_text(args.text)
        else:
            pcm, rate = read_wav(args.wav)
            if rate != USER_RATE:
                pcm = float_to_int16(resample(int16_to_float(pcm), rate, USER_RATE))
            result = await conv.say_audio(pcm, realtime=args.realtime)
    for err in conv.errors:
        print(f"error {err['code']}: {err['message']}", file=sys.stderr)
    print(f"you:   {result.final_text}")
    print(f"agent: {result.response_text}")
    seconds = len(result.audio) / REPLY_RATE
    ttfa = result.time_to_first_audio
    print(f"audio: {seconds:.2f} s in {len(result.chunks)} chunks"
          + (f", first after {ttfa * 1000:.0f} ms" if ttfa is not None else ""), file=sys.stderr)
    if args.out:
        write_wav(args.out, result.audio, REPLY_RATE)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
