// Render the \( … \) and \[ … \] that pymdownx.arithmatex (generic mode) leaves in the page, with the KaTeX the
// site serves itself (docs/assets/katex): no CDN, so the docs read offline. Material's instant navigation
// swaps pages without a reload, so render on each of its page events too.
function renderMath() {
  document.querySelectorAll(".arithmatex").forEach(function (element) {
    renderMathInElement(element, {
      delimiters: [{left: "\\(", right: "\\)", display: false}, {left: "\\[", right: "\\]", display: true}],
      throwOnError: true,
    });
  });
}
if (typeof document$ !== "undefined") {
  document$.subscribe(renderMath);
} else {
  document.addEventListener("DOMContentLoaded", renderMath);
}
