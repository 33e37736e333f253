# Builds dist\runmyai-VERSION-windows-x64-setup.exe on Windows 10/11 x64.
# NOT RUN on our (Linux) machines: written from the Linux build and PyInstaller's and Inno Setup's documentation.
# Needs: Python 3.11-3.13 (x64), Visual Studio 2022 Build Tools (C++), CMake, Inno Setup 6 (iscc on PATH).
$ErrorActionPreference = "Stop"
Set-Location (Join-Path $PSScriptRoot "..\..")

if (-not (Test-Path .venv)) { py -3.11 -m venv .venv }
. .\.venv\Scripts\Activate.ps1
python -m pip install -q --upgrade "pip>=24"
python -m pip install -q -e ".[dev,installer]" pillow   # Pillow: PyInstaller turns the PNG icon into an .ico
# ggml: engine/ggml/CMakeLists.txt (every x86-64 CPU level as a module, GGML_BACKEND_DL) from the pinned source,
# laid out as compute/ggml_api.py loads it on Windows: lib\ggml-base.dll, lib\ggml.dll, backends\cpu\ggml-cpu-*.dll.
# engine/ggml/build.sh does this on Linux; its Windows port is not written yet (docs/dependencies.md).
$ggml = Join-Path $env:VIRTUAL_ENV "lib\tokenwing-ggml"
if (-not (Test-Path (Join-Path $ggml "lib\ggml.dll"))) { throw "no ggml build in $ggml (engine/ggml/build.sh's Windows port)" }
$env:RUNMYAI_GGML = $ggml

$version = (Select-String -Path engine\tokenwing\version.py -Pattern '__version__ = "(.+)"').Matches[0].Groups[1].Value
python -m PyInstaller --noconfirm --distpath build\installer\dist --workpath build\installer\work installer\runmyai.spec
& .\build\installer\dist\runmyai\tokenwing.exe --version
iscc /DAppVersion=$version installer\windows\runmyai.iss
Write-Host "dist\runmyai-$version-windows-x64-setup.exe"
