"""Pipecat's OpenAIRealtimeLLMService on gapless, in a pipeline with no transport."""
import asyncio, os, sys
from pipecat.frames.frames import EndFrame, LLMContextFrame, LLMFullResponseEndFrame, TTSAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

URL = os.environ.get("GAPLESS_URL", "http://127.0.0.1:8000").replace("http", "ws", 1)
KEY = os.environ.get("GAPLESS_TOKEN", "x")

class Count(FrameProcessor):
    frames = 0
    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        Count.frames += isinstance(frame, TTSAudioRawFrame)
        if isinstance(frame, LLMFullResponseEndFrame):
            await worker.queue_frame(EndFrame())
        await self.push_frame(frame, direction)

llm = OpenAIRealtimeLLMService(api_key=KEY, base_url=f"{URL}/v1/realtime",
                               settings=OpenAIRealtimeLLMService.Settings(model="gapless"))
worker = PipelineWorker(Pipeline([llm, Count()]))
failed = []

@worker.event_handler("on_pipeline_error")
async def on_pipeline_error(worker, frame):  # e.g. no server there: end now instead of retrying
    failed.append(frame.error)
    await worker.cancel()

async def main():
    await worker.queue_frame(LLMContextFrame(LLMContext(messages=[{"role": "user", "content": "Say hello."}])))
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await runner.run()
    if failed:
        sys.exit(f"cannot reach gapless at {URL}: {failed[0]}")
    print(f"{Count.frames} audio frames")

try:
    asyncio.run(asyncio.wait_for(main(), 60))
except asyncio.TimeoutError:
    sys.exit(f"no reply from gapless at {URL} within 60 s (is it running?)")
