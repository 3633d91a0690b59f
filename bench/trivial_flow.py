"""The trivial job both dispatch paths run: it returns at once."""

from prefect import flow


@flow(name="trivial")
def trivial(i: int = 0) -> int:
    return i
