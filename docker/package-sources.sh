# Sourced (sh) by the Dockerfile's install steps: points pip and uv at the build's package
# sources. PACKAGE_INDEX (build arg): an index URL used instead of the installers' default,
# or `none` for no index; /tmp/hybrid-draft/wheels (the `wheels` build context) is searched
# first when it holds any wheel.
case "${PACKAGE_INDEX:-}" in
    "") ;;
    # uv reads no environment variable for --no-index; offline, it reads find-links only
    none) export PIP_NO_INDEX=1 UV_OFFLINE=1 ;;
    *) export PIP_INDEX_URL="$PACKAGE_INDEX" UV_DEFAULT_INDEX="$PACKAGE_INDEX" ;;
esac
if ls /tmp/hybrid-draft/wheels/*.whl >/dev/null 2>&1; then
    export PIP_FIND_LINKS=/tmp/hybrid-draft/wheels UV_FIND_LINKS=/tmp/hybrid-draft/wheels
fi
