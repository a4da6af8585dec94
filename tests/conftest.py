import sys
from pathlib import Path

# Test helpers (tiny models, the local S3 server) are plain modules beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
