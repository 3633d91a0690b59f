"""The queue monitor's data layer, as one import (a facade; nothing is defined here). Deprecated.

Nothing in dashboard/ imports it (tests/test_dashboard_layers.py checks): the pages and modules import
each name from the module that owns it. It stays only for the importers outside the dashboard that
have not moved yet (``prefect_launch/cli.py``, a few tests, ``bench/page_parts.py``) and goes once
they have. Where each name lives:

* :mod:`.spec`: the sidebar's selection (``ViewSpec``), status vocabulary, time helpers;
* :mod:`.api`: the Prefect API reader (client, filter bodies, bounded reads);
* :mod:`.api_cache`: what the API path keeps between views (runs, history buckets);
* :mod:`.index_sync` / :mod:`.index_view`: the run index, kept in step with Prefect, and
  the prepared run rows both sources give;
* :mod:`.frames`: the one pure producer of each run panel's frame (:mod:`.occupancy`,
  :mod:`.summary` and :mod:`.cost` for theirs);
* :mod:`.metrics_source`: the run metrics store, read per view;
* :mod:`.view`: view assembly (``load_view``).
"""

from __future__ import annotations

import datetime as dt  # noqa: F401  (callers use D.dt)

from prefect_launch.dashboard.api import (  # noqa: F401
    PAGE, Api, fetch_agents, fetch_deployments, fetch_error_logs, fetch_errors, fetch_history, fetch_now_counts, fetch_pools,
    fetch_runs, fetch_runs_by_id, fetch_workers, filter_body, get_api, history_from_api, run_matches, run_url, tag_combos,
)
from prefect_launch.dashboard.api_cache import HISTORY_CACHE, RUN_CACHE, HistoryCache, RunCache, grouped_history  # noqa: F401
from prefect_launch.dashboard.frames import (  # noqa: F401
    agents_frame, errors_frame, gantt_frame, history_frame, now_counts_frame, pools_frame, queued_and_duration, queued_time,
    runs_frame, status_counts, subtract_groups, top_groups, totals, workers_frame,
)
from prefect_launch.dashboard.metrics_source import (  # noqa: F401
    METRICS_CACHE, STORE_CACHE, TtlCache, apply_filters, fetch_metrics, fetch_metrics_cached, metrics_frame, metrics_store,
    waste_frame,
)
from prefect_launch.dashboard.spec import (  # noqa: F401
    FINISHED, GROUPINGS, MAX_GROUPS, NICE_INTERVALS, NO_DEPLOYMENT, OTHER, RANGES, STATUS_COLORS, STATUS_OF_TYPE, STATUSES,
    TERMINAL_TYPES, TYPES_OF_STATUS, UNKNOWN, UTC, ViewSpec, aligned_range, group_column, interval_for, narrows, time_window,
)
from prefect_launch.dashboard.view import (  # noqa: F401
    OCCUPANCY_LOOKBACK, RunInputs, View, clear_caches, index_status, load_view, occupancy_view, options,
)
