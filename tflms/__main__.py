import sys

from tflms.cli import main

sys.exit(main())
