"""An example job that needs a package the agent's Python lacks (tabulate): its deployment in prefect.yaml
declares ``environment: {requirements: examples/requirements-report.txt}``, and the agent builds that
environment once (docs/jobs-and-queues.md, "Job environments")."""

from prefect import flow, get_run_logger


@flow(name="report")
def report(rows: int = 5) -> str:
    from tabulate import tabulate  # only the job's environment has it

    table = tabulate([(i, i * i) for i in range(rows)], headers=["n", "n^2"])
    get_run_logger().info("\n%s", table)
    return table
