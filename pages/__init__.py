"""The dashboard's pages (live.py, compare.py, runs.py) and the modules they share (see app.py).

Streamlit treats a folder named `pages/` beside the entry script as a "v1" multipage app and, until
a script calls st.navigation, runs a deep-linked file from it directly, without app.py (a fresh
server whose first request is /compare would skip the sidebar and the database checks, and every
shared module here would be listed as a page). Routing here is st.navigation in app.py only, so
the v1 mode is switched off as soon as any page module is imported, with the same flag
st.navigation sets; pages/data.py `page_context` reruns a page that ran without app.py.
"""
try:
    from streamlit.runtime.pages_manager import PagesManager

    PagesManager.uses_pages_directory = False
except Exception:  # noqa: BLE001 - a newer Streamlit without the flag needs nothing
    pass
