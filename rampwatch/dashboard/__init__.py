"""The dashboard: app.py (navigation, sidebar, database checks) runs one of the page scripts in
views/ (live.py, compare.py, runs.py). Data access lives in store_access.py only; the Streamlit-free
logic beside it: recommend.py (the card's decisions), buckets.py and smoothing.py (chart data),
comparison.py (cross-run arithmetic); drawing in charts.py and card.py."""
