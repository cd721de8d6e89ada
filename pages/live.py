"""The Live run page, from a checkout. Streamlit runs a file in pages/ itself when a fresh server's
first request names it (/live), so this runs the whole app, which routes by the URL: the sidebar
and the database checks always come first. The page: rampwatch/dashboard/views/live.py."""

from rampwatch.dashboard.app import main

main()
