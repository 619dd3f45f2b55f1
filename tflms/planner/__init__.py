"""The planner: replays training-step traces through the LMS engine on modelled GPUs.

It answers two questions before anyone builds a patched TensorFlow: will the
model fit with LMS, and how much slower will it run (`tflms simulate`,
`tflms demo`, `tflms results`).
"""
