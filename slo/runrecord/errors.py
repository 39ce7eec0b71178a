"""The exception the run-record module raises for a run directory it cannot read or write."""


class RunRecordError(Exception):
    """A run directory, table or document that does not follow the run-record contract.

    The message is one sentence that names the problem; CLIs turn it into exit code 2.
    """
