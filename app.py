"""The dashboard from a checkout: `streamlit run app.py -- --db PATH [--read-only]`.
Installed, the same app is `rampwatch dashboard --db PATH`; it lives in rampwatch/dashboard/."""

from rampwatch.dashboard.app import main

main()
