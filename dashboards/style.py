"""What the browser runs besides Dash: the page's style sheet and two small clientside scripts.

Kept apart from the app so the layout and callbacks read without a screen of CSS. The scripts
run as Dash clientside callbacks, so the Content-Security-Policy allows them by their hashes
(``dashboards.headers``); nothing here is loaded from elsewhere.
"""

from __future__ import annotations

from typing import Final

__all__ = ["SORT_JS", "STYLE", "TZ_JS"]

STYLE: Final = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1d2430;
       background: #f8f9fb; }
header { display: flex; gap: 1em; align-items: center; padding: .55em 1.2em; background: #1d2430;
         min-height: 2.4em; }
header .brand { color: #fff; font-weight: 700; letter-spacing: .02em; }
#nav { display: flex; flex: 1; flex-wrap: wrap; gap: .4em 1em; align-items: center; min-width: 0; }
#nav > a { white-space: nowrap; }
#nav > a { color: #d0d5dd; text-decoration: none; } #nav > a:hover { color: #fff; }
#nav .spacer { flex: 1; } #who { color: #fff; }
#nav label { color: #d0d5dd; font-size: .9em; }
#summary-wrap { padding: .8em 1.2em 0; }
.tiles { display: grid; grid-template-columns: repeat(auto-fit, minmax(175px, 1fr)); gap: .6em; }
.tile { background: #fff; border: 1px solid #e4e7ec; border-radius: 8px; padding: .6em .8em; }
.tile-label { font-size: .8em; color: #475467; text-transform: uppercase; letter-spacing: .04em; }
.tile-value { font-size: 1.55em; font-weight: 650; font-variant-numeric: tabular-nums; margin: .1em 0; }
.tile-detail { font-size: .8em; color: #475467; }
.as-of { font-size: .8em; color: #475467; margin: .4em 0 0; }
.page { padding: 0 1.2em 2em; }
.page h3 { margin: 1.2em 0 .3em; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: .6em; }
.grid .dash-graph, .wide .dash-graph { background: #fff; border: 1px solid #e4e7ec;
                                       border-radius: 8px; }
/* The chart toolbar only while the pointer is over its chart, never over a title. */
.js-plotly-plot .modebar-container { opacity: 0; transition: opacity .15s; }
.js-plotly-plot:hover .modebar-container { opacity: 1; }
.table-wrap { max-width: 100%; overflow-x: auto; }
.frame-table { border-collapse: collapse; font-size: .86em; margin: .5em 0; background: #fff;
               font-variant-numeric: tabular-nums; }
.frame-table th, .frame-table td { border-bottom: 1px solid #e4e7ec; padding: .35em .55em;
                                   text-align: left; white-space: nowrap; }
/* Headers wrap between words, never inside one: "Monthly budget" is two whole words. */
.frame-table th { background: #f2f4f7; font-weight: 600; white-space: normal; vertical-align: bottom;
                  overflow-wrap: normal; word-break: keep-all; hyphens: none; }
.frame-table tbody tr.clickable { cursor: pointer; }
.frame-table thead th { cursor: pointer; user-select: none; }
.frame-table th[aria-sort="ascending"]::after { content: " \\25B2"; font-size: .7em; }
.frame-table th[aria-sort="descending"]::after { content: " \\25BC"; font-size: .7em; }
.frame-table .num { text-align: right; }
.frame-table tbody tr:hover { background: #f5f8ff; }
.frame-table tfoot td { font-weight: 700; border-top: 2px solid #1d2430; }
.note { color: #475467; } .note-error { color: #b42318; } .ok { color: #067647; font-weight: 600; }
.form, .toolbar { display: flex; flex-wrap: wrap; gap: .8em; align-items: end; margin: .5em 0; }
.field { display: flex; flex-direction: column; min-width: 11em; }
#login { max-width: 28em; margin: 3em auto; background: #fff; padding: 1em 1.5em 1.5em;
         border: 1px solid #e4e7ec; border-radius: 8px; }
#login input { width: 100%; box-sizing: border-box; padding: .4em; margin: .3em 0 .6em; }
"""

# The viewer's IANA time zone, read once per page load, so times are drawn in local time.
TZ_JS: Final = "function(_) { return Intl.DateTimeFormat().resolvedOptions().timeZone || 'UTC'; }"

# Sorting for every table: one click listener on the document (installed once), so tables drawn
# later by any callback sort too. A header click sorts the body rows by that column, ascending
# then descending; numbers compare as numbers ("$1,234.56", "12.5 %"), the total row stays last.
SORT_JS: Final = r"""function(_) {
  if (window.infermeterSort) { return 1; }
  window.infermeterSort = true;
  var value = function (cell) {
    var text = cell ? cell.textContent.trim() : '';
    var numeric = /^-?\$?[\d,]*\.?\d+( %| s| GB)?$/.test(text);
    return numeric ? parseFloat(text.replace(/[^\d.\-]/g, '')) : text.toLowerCase();
  };
  document.addEventListener('click', function (event) {
    var th = event.target.closest('.frame-table thead th');
    if (!th) { return; }
    var table = th.closest('table'), body = table.tBodies[0];
    var index = Array.prototype.indexOf.call(th.parentNode.children, th);
    var descending = th.getAttribute('aria-sort') === 'ascending';
    Array.prototype.forEach.call(th.parentNode.children, function (h) { h.removeAttribute('aria-sort'); });
    th.setAttribute('aria-sort', descending ? 'descending' : 'ascending');
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = value(a.cells[index]), y = value(b.cells[index]);
      var order = (typeof x === typeof y) ? (x < y ? -1 : x > y ? 1 : 0) : (typeof x === 'number' ? -1 : 1);
      return descending ? -order : order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  });
  return 1;
}"""
