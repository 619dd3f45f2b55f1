"""Building TensorFlow with the LMS patch, and running programs pinned to a GPU's NUMA node.

Modules:
    preflight    checks of the build host, pure functions over gathered facts
    state        the resume file recording which build stages are done, and with what
    runner       running long commands with a log file, progress and error extraction
    wheel        the build-wheel pipeline (clone, apply, configure, build, rename)
    wheel_label  giving a built wheel the local version label that says it carries LMS
    numa         finding the NUMA node of the visible GPU and wrapping a command in numactl
    cli          the `tflms build-wheel` and `tflms run` subcommands
"""
