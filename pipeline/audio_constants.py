"""The audio facts every part of the pipeline shares, defined once.

The user's side (microphone, VAD, echo canceller, Smart Turn, recogniser) runs at 16 kHz; the
bot's side (TTS, the Mimi codec, reply audio, voice clips) at 24 kHz. Mimi turns 24 kHz audio into
one frame of codes per 80 ms (12.5 Hz). All audio that crosses a module boundary is int16 mono.
"""
USER_RATE = 16_000  # samples a second of the user's audio: microphone, VAD, Smart Turn, STT
REPLY_RATE = 24_000  # samples a second of the bot's audio: TTS, Mimi, reply audio, voice clips
CODEC_FRAME_SAMPLES = 1920  # REPLY_RATE samples in one Mimi frame of codes
CODEC_FRAME_S = CODEC_FRAME_SAMPLES / REPLY_RATE  # 0.08 s
