"""An example job that needs a package the agent's Python lacks (tabulate). prefect.yaml deploys it five ways,
each declaring ``environment: {requirements: examples/requirements-report.txt}``: report-env (code job, process
queue: a virtual environment per content hash), report-git-env (git job, process queue), report-docker-env (code
job on the docker queue: an image per content hash), report-git-docker-env (git job on the docker queue, cloned in
the container) and report-image-env (image job: examples/Dockerfile copies this file into the image). See
docs/jobs-and-queues.md, "Job environments"."""

from prefect import flow, get_run_logger


@flow(name="report", persist_result=True)  # the table is readable from the API
def report(rows: int = 5) -> str:
    from tabulate import tabulate  # only the job's environment has it

    table = tabulate([(i, i * i) for i in range(rows)], headers=["n", "n^2"])
    get_run_logger().info("\n%s", table)
    return table
