import sys

from runtime.bench.main import main

sys.exit(main())
