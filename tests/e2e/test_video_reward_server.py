"""The video reward through the real reward server (a subprocess on a free localhost port): rollout videos go
out as frame strips with their metadata and come back scored exactly as in process; a strip without its frame
count is refused (422) with a message naming the missing metadata."""

from __future__ import annotations

import numpy as np
import torch

from megatron_omni.reward.client import RewardClient
from megatron_omni.reward.launcher import RewardServerProcess
from megatron_omni.reward.registry import build_scorer
from megatron_omni.reward.video import video_strip
from tests.e2e.test_reward_server import item, post
from tests.unit.test_video_reward import text_video

SPEC = "video_ocr+0.5*temporal_consistency"


def test_videos_are_scored_through_the_server() -> None:
    videos = [torch.from_numpy(text_video("OPEN", 5)).permute(0, 3, 1, 2).float() / 255,  # as a rollout's frames
              text_video(None, 5), text_video("GO", 5, seed=1)]
    strips = [video_strip(v, 3) for v in videos]
    prompts = ['a sign "OPEN"', 'a sign "OPEN"', 'the word "GO"']
    local = build_scorer(SPEC)([s for s, _ in strips], prompts, [m for _, m in strips])
    assert local[0] > 1.4 and local[1] < 0.45, local  # legible and still vs unreadable noise
    with RewardServerProcess(SPEC, workers=1, max_queue=16, timeout_s=60) as srv:
        assert srv.health()["scorer"] == "1*video_ocr+0.5*temporal_consistency"
        with RewardClient(srv.url, timeout_s=60) as client:
            for i in (2, 0, 1):  # streamed as samples finish
                client.submit(i, strips[i][0], prompts[i], strips[i][1])
            assert client.gather() == local
        status, body, _ = post(srv.url, {"items": [item(strips[0][0], prompts[0])]})
        assert status == 422 and "metadata['frames']" in body["error"], body
    assert np.isfinite(local).all()
