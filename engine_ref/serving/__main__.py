"""`python -m engine_ref.serving ...`: the `bench serve` command, run standalone."""

from engine_ref.serving.cli_serve import serve

if __name__ == "__main__":
    serve.main(prog_name="python -m engine_ref.serving")
