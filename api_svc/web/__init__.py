"""The web console: a tenant's jobs in a browser, served by the tenant API at `/console`.

The page is a shell with no tenant data in it: it asks for the tenant's API key once, keeps
it in the tab's `sessionStorage` and sends it as `Authorization: Bearer` on every `fetch()`
to the API's own JSON routes (`/v1/jobs`, `/v1/jobs/{job}/episodes`, the commands, the
export) and to `/console/charts`, which draws the tenant's curves with the report's chart
code (marlaas/report). No cookie carries the key, so no other site can make the browser act
with it (nothing to forge a request with: no CSRF), and it is never in a URL. The pages
allow only their own scripts and styles (a Content-Security-Policy), and the script writes
every text it is given as text, never as markup.

`page` holds the files (written here, under `static/`: no CDN, nothing fetched from
elsewhere) and the headers they are served with; `curves` picks the charts; `routes` serves
them.
"""
