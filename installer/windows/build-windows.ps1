# Builds dist\runmyai-VERSION-windows-x64-setup.exe on Windows 10/11 x64.
# NOT RUN on our (Linux) machines: written from the Linux build and PyInstaller's and Inno Setup's documentation.
# Needs: Python 3.11-3.13 (x64), Visual Studio 2022 Build Tools (C++), CMake, Inno Setup 6 (iscc on PATH).
$ErrorActionPreference = "Stop"
Set-Location (Join-Path $PSScriptRoot "..\..")

if (-not (Test-Path .venv)) { py -3.11 -m venv .venv }
. .\.venv\Scripts\Activate.ps1
python -m pip install -q --upgrade "pip>=24"
# ggml for the portable floor (AVX2), not -march=native; the spec bundles it as the one variant "generic".
$env:CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
python -m pip install -q --force-reinstall --no-deps --no-cache-dir --no-binary ggml-python "ggml-python==0.0.45"
Remove-Item Env:\CMAKE_ARGS
python -m pip install -q -e ".[installer]" pillow   # Pillow: PyInstaller turns the PNG icon into an .ico

$version = (Select-String -Path engine\tokenwing\version.py -Pattern '__version__ = "(.+)"').Matches[0].Groups[1].Value
$env:RUNMYAI_GGML_VARIANTS = "build\ggml-variants-windows"   # absent: the installed ggml-python is the variant
python -m PyInstaller --noconfirm --distpath build\installer\dist --workpath build\installer\work installer\runmyai.spec
& .\build\installer\dist\runmyai\tokenwing.exe --version
iscc /DAppVersion=$version installer\windows\runmyai.iss
Write-Host "dist\runmyai-$version-windows-x64-setup.exe"
