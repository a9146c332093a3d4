// Tables that fit their screen (with stylesheets/extra.css; checked by tests/site_check.py):
// - each cell gets its column's header as data-label, which a phone shows before the
//   cell (the row is then a card);
// - inline code in a cell may break after `_`, `.`, `/`, `=` or `,` (a <wbr> between
//   pieces that never break), nowhere else: not at a hyphen, not inside a word.
function fitTables() {
  document.querySelectorAll("article table").forEach((table) => {
    const heads = [...table.querySelectorAll("thead th")].map((th) => th.textContent.trim());
    table.querySelectorAll("tbody tr").forEach((tr) => {
      [...tr.children].forEach((td, i) => td.setAttribute("data-label", heads[i] || ""));
    });
    table.querySelectorAll("code").forEach((code) => {
      if (code.classList.contains("breaks")) return;
      code.classList.add("breaks");
      const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
      const texts = [];
      for (let node = walker.nextNode(); node; node = walker.nextNode()) texts.push(node);
      texts.forEach((node) => {
        const pieces = document.createDocumentFragment();
        node.data.split(/(?<=[_./=,])/).forEach((part, i) => {
          if (i) pieces.appendChild(document.createElement("wbr"));
          const piece = document.createElement("span");
          piece.className = "piece";
          piece.textContent = part;
          pieces.appendChild(piece);
        });
        node.replaceWith(pieces);
      });
    });
  });
}
if (typeof document$ !== "undefined") document$.subscribe(fitTables);
else document.addEventListener("DOMContentLoaded", fitTables);
