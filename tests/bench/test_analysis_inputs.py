"""The bench's analysis scripts refuse a folder that holds none of the records they read."""

import pytest


@pytest.mark.parametrize("script,missing", [("ttft_floor.py", "no requests.jsonl.gz"),
                                            ("kv_pressure.py", "no pod-samples.jsonl")])
def test_a_folder_without_the_records_is_refused(tmp_path, analysis, script, missing):
    code, _, err = analysis(script, tmp_path)
    assert code != 0
    assert missing in err
